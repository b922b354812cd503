"""generate.py at temperature 0.8 with top-p 0.95 and adaptive gamma."""

from configs import generate


def get_config():
    c = generate.get_config()
    c.temperature = 0.8
    c.top_p = 0.95
    c.adaptive_gamma = True
    return c
