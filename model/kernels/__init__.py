"""Optional fused kernels (GPU); every one has a plain-PyTorch reference in model/."""
