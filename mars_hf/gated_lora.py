"""Adapters gated to mask positions (MARS_SPEC §7). Being written (issue 11)."""
