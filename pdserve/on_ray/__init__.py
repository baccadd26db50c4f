"""pdserve on a Ray cluster: `pdserve serve --ray` and `pdserve scale` (the `ray` extra)."""
