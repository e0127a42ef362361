/* native_dsinks: the native core's flash_bwd_dsinks variant and key, one call a line (tests/test_flash_bwd_dsinks.py):
 * "capability varlen seqused_q index64", answered "ok VARIANT KEY" or "error MESSAGE". */
#include <stdio.h>
#include "lt_native.h"
int main(void) {
    int capability, varlen, used, wide;
    while (scanf("%d %d %d %d", &capability, &varlen, &used, &wide) == 4) {
        ltn_variant v;
        ltn_error err;
        char text[512], key[33];
        if (ltn_dsinks_variant(capability, varlen, used, wide, &v, &err) != LTN_OK)
            printf("error %s\n", err.message);
        else if (ltn_variant_string(&v, text, sizeof text) == 0 && ltn_variant_key(&v, key) == 0)
            printf("ok %s %s\n", text, key);
    }
    return 0;
}
