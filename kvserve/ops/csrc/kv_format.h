/* Row formats of a paged KV pool (kv_format; ops/cpu_kernels.py KV_FORMATS maps torch dtypes to
 * them): float32 rows, int8 rows followed by their float32 scale (ops/kv_int8.py), IEEE half rows. */
#ifndef KVSERVE_KV_FORMAT_H
#define KVSERVE_KV_FORMAT_H

#define KV_F32 0
#define KV_INT8 1
#define KV_F16 2

#endif
