"""Replication origins in the apply stage (``apply.origins``) without a server."""

from __future__ import annotations

from applier.apply.origins import default_origin_name


def test_origin_name_names_slot_and_database() -> None:
    assert default_origin_name("s", "app") == "applier_s_app"


def test_a_slot_named_applier_is_not_prefixed_twice() -> None:
    assert default_origin_name("applier_app", "shop") == "applier_app_shop"
