"""Schedule times, shared by Vertex AI schedules and Kubeflow recurring runs: a 5-field cron, optional TZ= prefix."""

from __future__ import annotations

import re
import zoneinfo

from configs import UserError

_CRON_TZ = re.compile(r"(?:CRON_)?TZ=(\S+)\s+(.*)")


def normalize_cron(cron: str) -> str:
    """Check a cron (5 fields, optional `TZ=Area/City` prefix) here rather than on the server."""
    text = " ".join(cron.split())
    tz, fields = None, text
    if m := _CRON_TZ.fullmatch(text):
        tz, fields = m.groups()
        try:
            zoneinfo.ZoneInfo(tz)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise UserError(f"cron {cron!r}: unknown time zone {tz!r} (an IANA name such as Europe/Paris)") from None
    if len(fields.split()) != 5:
        raise UserError(f"cron {cron!r}: expected 5 fields (minute hour day-of-month month day-of-week), "
                        f"optionally after TZ=Area/City, e.g. 'TZ=Europe/Paris 0 3 * * 1'")
    return f"TZ={tz} {fields}" if tz else fields
