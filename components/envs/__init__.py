"""Environments: real adapters (TextWorld, MiniWoB++) and, later, the synthetic one, behind one interface."""
