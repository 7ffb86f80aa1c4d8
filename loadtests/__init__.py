"""Locust load tests: user classes (locustfile.py), the seeded request mix (prompts.py), the runner (run.py)."""
