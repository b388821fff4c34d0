"""Seed data: the trajectory contract, its validation, onboarding into data/, and collection in real environments."""
