"""Adversarial tests: one per hardening case (docs/security.md), bounded in time and count."""
