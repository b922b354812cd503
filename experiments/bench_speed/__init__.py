"""Speed benchmark of specjax: target-only, transformers, roofline, forward costs, speculative decoding."""
