"""Serving: a request scheduler that keeps a fixed batch of slots full (a finished row's slot
is refilled with the next request), for load studies and batched data generation; the same on
the real clock in an engine thread (`LiveScheduler`), and an OpenAI-compatible HTTP API over it
(`make_app`, run by `specjax serve`). Both may run each round at the smallest batch size its busy
rows need (`Buckets`), so adaptive gamma prices rounds at the load they run at."""

from specjax.serving._buckets import Buckets
from specjax.serving._http import make_app
from specjax.serving._live import LiveScheduler, QueueFull, Stopped
from specjax.serving._scheduler import (Request, RequestResult, Scheduler, ServeOutput, gamma_arrivals,
                                        generate_offline, poisson_arrivals, summarize)

__all__ = ["Buckets", "LiveScheduler", "QueueFull", "Request", "RequestResult", "Scheduler", "ServeOutput", "Stopped",
           "gamma_arrivals", "generate_offline", "make_app", "poisson_arrivals", "summarize"]
