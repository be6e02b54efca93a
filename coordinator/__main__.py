"""`python -m coordinator`: the `edgefl` command line, runnable with any interpreter (the demo
starts its coordinator and device processes this way, with its own `sys.executable`)."""

from coordinator.cli import main

if __name__ == "__main__":
    main()
