"""CPU kernels of our own: quantised-weight linears (`quant`), JIT-built from `csrc/` (`build`)."""
