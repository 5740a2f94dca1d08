from opencomposer.cli import main

raise SystemExit(main())
