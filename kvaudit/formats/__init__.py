"""The machine forms of kvaudit's results, one module per format: ``json.py`` (records,
diff reports, inventories, planted faults), ``csv.py`` (records), ``junit.py`` (diff
reports). A new report format is one module here, called from ``kvaudit.cli``."""

from __future__ import annotations

from ..core.lazy import lazy_exports

# Each format's module is imported when first asked for: `checksum --format json` imports
# neither CSV nor XML.
_EXPORTS = {
    "diff_junit": ".junit",
    **dict.fromkeys(("CSV_HEADER", "record_csv", "record_csv_rows"), ".csv"),
    **dict.fromkeys(
        (
            "DIFF_FORMAT",
            "INVENTORY_FORMAT",
            "diff_json_text",
            "diff_to_json",
            "inventory_to_json",
            "json_text",
            "planted_to_json",
            "record_to_json",
        ),
        ".json",
    ),
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
