from fastdpo.cli import main

raise SystemExit(main())
