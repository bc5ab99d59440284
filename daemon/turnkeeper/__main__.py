from turnkeeper.cli import main

raise SystemExit(main())
