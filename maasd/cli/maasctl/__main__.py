"""``python -m maasd.cli.maasctl``: the same as the ``maasctl`` console script."""

from maasd.cli.maasctl.app import main

main()
