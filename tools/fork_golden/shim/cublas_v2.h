/* Empty: PSPNet's util/interp.hpp includes cuBLAS's header even in a CPU-only build; its CPU code uses nothing from it. */
