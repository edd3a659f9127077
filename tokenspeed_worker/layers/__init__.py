"""Building blocks of the models: attention backends, norms, rotary embedding, linear layers, sampler."""
