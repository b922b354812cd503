"""generate.py at temperature 0.8 with top-p 0.95 (the hybrid drafter at gamma 3, as in generate.py)."""

from configs import generate


def get_config():
    c = generate.get_config()
    c.temperature = 0.8
    c.top_p = 0.95
    return c
