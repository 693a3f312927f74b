"""``python -m packer`` and the ``packer`` console script.

The CLI module imports click at its top, so a missing click would surface as a traceback before
any of packer's error handling exists; this entry point names the package in one line instead.
"""

import sys


def run() -> None:
    """Start the CLI; exit 1 with ``error: packer needs PACKAGE: …`` if it cannot be imported."""
    try:
        from packer.cli import main
    except ImportError as e:
        from packer.errors import missing_dependency

        print(f"error: {missing_dependency(e)}", file=sys.stderr)
        raise SystemExit(1) from None
    # Printed text is escaped (packer.util.show) but may still hold printable non-ASCII (a path, a
    # name in any script): on a terminal whose encoding cannot hold it, show it escaped too
    # rather than end in UnicodeEncodeError.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    main()


if __name__ == "__main__":
    run()
