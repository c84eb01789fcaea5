"""Drafters: one module each, all behind the ``Drafter`` protocol in base.py."""
