"""``python -m squeeze``: the CLI, as torchrun runs it too (``torchrun --nproc-per-node N -m squeeze compress``)."""

from squeeze.cli.app import main

if __name__ == "__main__":
    main()
