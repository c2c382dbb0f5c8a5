"""Replication origins in the apply stage (``apply.origins``) without a server."""

from __future__ import annotations

from applier.apply.origins import default_origin_name


def test_origin_name_names_slot_and_database() -> None:
    assert default_origin_name("s", "app") == "applier_s_app"
