from poolrunner.core.cli.main import main

raise SystemExit(main())
