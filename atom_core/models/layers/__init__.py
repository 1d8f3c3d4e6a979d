"""Building blocks of the model files: tensor-parallel linears, embeddings, norms, rotary, attention, MLP."""
