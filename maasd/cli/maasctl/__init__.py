"""``maasctl``: the admin CLI of maasd (docs/maasctl.md), built on :class:`maasd.client.Client`.

It talks to the REST API only — no database, no memory of its own — so it works
the same against a local or a remote daemon. One module per noun:

=================  ==========================================================
``status``         ``status`` (pools, tenants, totals) and ``top`` (live view)
``top``            the machinery of ``top``: metrics parsing, rates, keys, frames
``usage``          ``usage`` (a tenant's own) and ``topology``
``pools``          ``pools list|show|create|delete``
``tenants``        ``tenants list|show|create|set-quota|delete``
``keys``           ``keys issue|revoke``
``buffers``        ``buffers list|show|release``
``events``         ``events`` (the audit trail)
``context``        options, keys per role, the client, NAME|ID, ``--json`` output
``formatting``     safe table cells, sizes, times, bars (rich)
``text``           tenant strings made visible (pure)
``units``          SIZE arguments (on :mod:`maasd.units`) and bars
``errors``         one-line errors and exit codes
``app``            the root group and ``main``
=================  ==========================================================

Human output is rich tables in which every tenant-supplied string is text, never
markup, with control characters made visible; ``--json`` before the subcommand
prints exactly what the API returned.
"""

from maasd.cli.maasctl.app import cli, main

__all__ = ["cli", "main"]
