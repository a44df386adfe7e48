"""``python -m tracer_cli`` (also how ``torchrun -m tracer_cli`` runs gradtrace)."""

from tracer_cli.cli import main

if __name__ == "__main__":
    main()
