"""Prefill-decode (PD) disaggregation. ``transport``: moving KV bytes between a prefill and a decode process."""
