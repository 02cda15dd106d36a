/* Row copies between two pools' tensors on the CPU: dst row di[i] of each outer slice
   becomes src row si[i], one memcpy a row, read once and written once (torch's
   index_select then index_copy_ moves every byte twice and costs more per call than a
   layer's pages take to copy). The caller checks the indices and the layouts. */
#include <stdint.h>
#include <string.h>

void ur_copy_rows(const char *src, int64_t src_outer, int64_t src_row, const int64_t *si,
                  char *dst, int64_t dst_outer, int64_t dst_row, const int64_t *di,
                  int64_t n, int64_t outer, int64_t row_bytes) {
    for (int64_t o = 0; o < outer; o++) {
        const char *s = src + o * src_outer;
        char *d = dst + o * dst_outer;
        for (int64_t i = 0; i < n; i++)
            memcpy(d + di[i] * dst_row, s + si[i] * src_row, (size_t)row_bytes);
    }
}
