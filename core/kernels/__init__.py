"""poolrunner's compute kernels: packed attention, the CPU fast path (oneDNN prepacking, int8
products, fused RMSNorm) and the C++ sources built for it. They run layers; reading a model
folder is :mod:`poolrunner.core.model`'s."""
