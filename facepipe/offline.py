"""Environment hygiene: no command of facepipe ever calls out to the network.

Set before any third-party import that reads these variables (Prefect reads its settings at import,
albumentations checks for updates at import). Values already set by the user are kept.
"""

import os

OFFLINE_ENV: dict[str, str] = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "NO_ALBUMENTATIONS_UPDATE": "1",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    # Not network, but the same place: the temporary local Prefect server migrates its SQLite
    # database on first start, which takes longer than Prefect's default wait on a busy 2-core box.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}


def apply() -> None:
    """Set the offline defaults in this process (and so in every child it starts)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
