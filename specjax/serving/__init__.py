"""Serving: a request scheduler that keeps a fixed batch of slots full (a finished row's slot
is refilled with the next request), for load studies and batched data generation."""

from specjax.serving._scheduler import (Request, RequestResult, Scheduler, ServeOutput, generate_offline,
                                        poisson_arrivals, summarize)

__all__ = ["Request", "RequestResult", "Scheduler", "ServeOutput", "generate_offline", "poisson_arrivals",
           "summarize"]
