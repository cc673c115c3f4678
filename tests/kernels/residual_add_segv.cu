// Deliberately hostile: residual_add_ends.cu ending the process with a segmentation fault on its first call.
#define TRTMC_ENDS_SEGV
#include "residual_add_ends.cu"
