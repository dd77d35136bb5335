from proxy.cli import main

if __name__ == "__main__":  # spawned children (workers, the parse process) import this too
    raise SystemExit(main())
