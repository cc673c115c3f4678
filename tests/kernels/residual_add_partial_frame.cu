// Deliberately hostile: residual_add_breaks_channel.cu writing a frame head that promises a body
// it never sends, then never returning.
#define TRTMC_CHANNEL_PARTIAL
#include "residual_add_breaks_channel.cu"
