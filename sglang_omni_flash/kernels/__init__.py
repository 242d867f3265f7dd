"""CPU kernels of this package, compiled on first use: row-invariant attention (`attention`), and the
helper that builds this package's C/C++ sources for the machine at hand (`build`)."""
