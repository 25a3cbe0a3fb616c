from servelm.cli.main import main

raise SystemExit(main())
