"""GPU (or any device) speed measurements on a random-weight Llama-shaped target; see README.md."""
