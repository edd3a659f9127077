"""The GPU kernels (Triton). Each module's AVAILABLE says whether it can run here; the layers
choose between them and their torch reference code."""
