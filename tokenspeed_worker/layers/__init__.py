"""Building blocks of the models: attention backends, norms, rotary embedding, linear layers, and the
small-batch GEMV choice their projections consult."""
