"""Prefect adapters over facepipe's stage functions (the library never imports Prefect)."""

import facepipe  # noqa: F401  - applies the offline environment before Prefect is imported
