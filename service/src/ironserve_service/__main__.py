from ironserve_service.cli import main

raise SystemExit(main())
