/* Exact TreeSHAP of a tree ensemble from per-leaf tables: the kernel of riskserve.wrappers.treeshap.
 *
 * A leaf's Shapley contributions to the k distinct features on its path depend on the row only through
 * which of those features the row "follows" (every split of that feature on the path goes the path's way):
 * one bit each, so 2^k cases, tabulated once per model in Python (treeshap.py). Per row this kernel
 * evaluates every split once, forms each leaf's bit pattern from its path and adds the tabulated values:
 * no recursion, no allocation per leaf, and the GIL is released for the whole batch. Rows go in blocks,
 * so a leaf's path and table are read once per block, and a large batch is shared with a second thread.
 *
 * Every index array is checked by the Python builder before it reaches this file; the kernel checks only
 * the buffer sizes it is handed, so a wrong call raises instead of reading out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Rows evaluated together; their split decisions for every node fit in L2 (nodes x BLOCK bytes,
 * stored node by node so that one node's decisions for the block's rows are contiguous). */
#define BLOCK 32
/* Batches of at least this many rows are shared with a second thread (a few ms of work each side). */
#define SPLIT 64
/* Fewer rows than this go one at a time (a block of one compiles to the plain per-row loops). */
#define SMALL 4

enum {
    B_X, B_NODE_FEATURE, B_NODE_THRESHOLD, B_NODE_DEFAULT_LEFT, B_PATH_START, B_PATH_NODE, B_PATH_LEFT,
    B_PATH_SLOT, B_SLOT_START, B_SLOT_FEATURE, B_TABLE_START, B_TABLE, B_OUT, B_COUNT
};

static int sized(const Py_buffer *buffer, Py_ssize_t itemsize, Py_ssize_t count, const char *name) {
    if (count < 0 || buffer->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", name, buffer->len, itemsize * count);
        return 0;
    }
    return 1;
}

/* The ensemble's arrays, as the Python builder lays them out (see treeshap.py). */
typedef struct {
    Py_ssize_t features, nodes, leaves;
    const int32_t *node_feature;
    const float *node_threshold;
    const unsigned char *node_default_left;
    const int64_t *path_start;
    const int32_t *path_node;
    const unsigned char *path_left;
    const unsigned char *path_slot;
    const int64_t *slot_start;
    const int32_t *slot_feature;
    const int64_t *table_start;
    const double *table;
} Ensemble;

/* Adds the contributions of nb consecutive rows (x, row-major) to out, leaf by leaf: each leaf's path and
 * table are read once for the block, and the block's bit patterns form in one vector loop. decisions holds
 * nodes x nb bytes, one node's decisions for the block's rows side by side. */
static inline __attribute__((always_inline)) void add_block(
    const Ensemble *e, const float *x, int nb, unsigned char *decisions, double *out) {
    for (Py_ssize_t m = 0; m < e->nodes; m++) {
        const int32_t f = e->node_feature[m];
        const float threshold = e->node_threshold[m];
        const unsigned char fallback = e->node_default_left[m];
        unsigned char *d = decisions + m * nb;
        for (int j = 0; j < nb; j++) {
            float value = x[j * e->features + f];
            d[j] = isnan(value) ? fallback : (unsigned char)(value < threshold);
        }
    }
    for (Py_ssize_t leaf = 0; leaf < e->leaves; leaf++) {
        const int64_t first = e->slot_start[leaf];
        const int64_t k = e->slot_start[leaf + 1] - first;
        if (k == 0) continue;
        uint32_t missed[BLOCK];
        for (int j = 0; j < nb; j++) missed[j] = 0;
        for (int64_t p = e->path_start[leaf]; p < e->path_start[leaf + 1]; p++) {
            const unsigned char *d = decisions + (Py_ssize_t)e->path_node[p] * nb;
            const unsigned char want = e->path_left[p];
            const uint32_t bit = (uint32_t)1 << e->path_slot[p];
            for (int j = 0; j < nb; j++) missed[j] |= d[j] != want ? bit : 0u;
        }
        const uint32_t all = ((uint32_t)1 << k) - 1;
        const double *base = e->table + e->table_start[leaf];
        const int32_t *slots = e->slot_feature + first;
        for (int j = 0; j < nb; j++) {
            const double *values = base + (int64_t)(all & ~missed[j]) * k;
            double *phi = out + j * e->features;
            for (int64_t u = 0; u < k; u++) phi[slots[u]] += values[u];
        }
    }
}

/* add_block over rows rows in blocks of BLOCK. */
static void add_rows(const Ensemble *e, const float *x, Py_ssize_t rows, unsigned char *decisions, double *out) {
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += BLOCK) {
        const int nb = (int)(rows - r0 < BLOCK ? rows - r0 : BLOCK);
        add_block(e, x + r0 * e->features, nb, decisions, out + r0 * e->features);
    }
}

/* The rows one thread takes: its own decisions buffer, its own rows of out. */
typedef struct {
    const Ensemble *e;
    const float *x;
    Py_ssize_t rows;
    unsigned char *decisions;
    double *out;
} Share;

static void *add_share(void *arg) {
    const Share *share = (const Share *)arg;
    add_rows(share->e, share->x, share->rows, share->decisions, share->out);
    return NULL;
}

static PyObject *contributions(PyObject *self, PyObject *args) {
    Py_buffer b[B_COUNT];
    Py_ssize_t rows, features, nodes, leaves, paths, slots, table_size;
    memset(b, 0, sizeof(b));
    if (!PyArg_ParseTuple(
            args, "nnnnnnny*y*y*y*y*y*y*y*y*y*y*y*w*", &rows, &features, &nodes, &leaves, &paths, &slots,
            &table_size, &b[B_X], &b[B_NODE_FEATURE], &b[B_NODE_THRESHOLD], &b[B_NODE_DEFAULT_LEFT],
            &b[B_PATH_START], &b[B_PATH_NODE], &b[B_PATH_LEFT], &b[B_PATH_SLOT], &b[B_SLOT_START],
            &b[B_SLOT_FEATURE], &b[B_TABLE_START], &b[B_TABLE], &b[B_OUT])) {
        for (int i = 0; i < B_COUNT; i++) {
            if (b[i].obj != NULL) PyBuffer_Release(&b[i]);
        }
        return NULL;
    }
    PyObject *result = NULL;
    unsigned char *decisions = NULL;
    if (!(sized(&b[B_X], 4, rows * features, "x") && sized(&b[B_NODE_FEATURE], 4, nodes, "node_feature") &&
          sized(&b[B_NODE_THRESHOLD], 4, nodes, "node_threshold") &&
          sized(&b[B_NODE_DEFAULT_LEFT], 1, nodes, "node_default_left") &&
          sized(&b[B_PATH_START], 8, leaves + 1, "path_start") && sized(&b[B_PATH_NODE], 4, paths, "path_node") &&
          sized(&b[B_PATH_LEFT], 1, paths, "path_left") && sized(&b[B_PATH_SLOT], 1, paths, "path_slot") &&
          sized(&b[B_SLOT_START], 8, leaves + 1, "slot_start") &&
          sized(&b[B_SLOT_FEATURE], 4, slots, "slot_feature") && sized(&b[B_TABLE_START], 8, leaves, "table_start") &&
          sized(&b[B_TABLE], 8, table_size, "table") && sized(&b[B_OUT], 8, rows * features, "out"))) {
        goto done;
    }
    {
        /* nodes bytes per row of a block; two blocks' worth when a second thread takes half the rows. A
         * row or a few need only their own (a whole block's buffer would be an mmap per declined row). */
        const Py_ssize_t width = rows >= SPLIT ? 2 * BLOCK : (rows < BLOCK ? (rows > 0 ? rows : 1) : BLOCK);
        decisions = (unsigned char *)malloc((size_t)(nodes > 0 ? nodes : 1) * (size_t)width);
    }
    if (decisions == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const Ensemble e = {
            .features = features,
            .nodes = nodes,
            .leaves = leaves,
            .node_feature = (const int32_t *)b[B_NODE_FEATURE].buf,
            .node_threshold = (const float *)b[B_NODE_THRESHOLD].buf,
            .node_default_left = (const unsigned char *)b[B_NODE_DEFAULT_LEFT].buf,
            .path_start = (const int64_t *)b[B_PATH_START].buf,
            .path_node = (const int32_t *)b[B_PATH_NODE].buf,
            .path_left = (const unsigned char *)b[B_PATH_LEFT].buf,
            .path_slot = (const unsigned char *)b[B_PATH_SLOT].buf,
            .slot_start = (const int64_t *)b[B_SLOT_START].buf,
            .slot_feature = (const int32_t *)b[B_SLOT_FEATURE].buf,
            .table_start = (const int64_t *)b[B_TABLE_START].buf,
            .table = (const double *)b[B_TABLE].buf,
        };
        const float *x = (const float *)b[B_X].buf;
        double *out = (double *)b[B_OUT].buf;
        Py_BEGIN_ALLOW_THREADS
        memset(out, 0, sizeof(double) * (size_t)(rows * features));
        if (rows < SMALL) {  /* a declined row or a few: the loops over a block of one, unrolled away */
            for (Py_ssize_t r = 0; r < rows; r++) add_block(&e, x + r * features, 1, decisions, out + r * features);
        } else if (rows < SPLIT) {
            add_rows(&e, x, rows, decisions, out);
        } else {  /* the second half of the blocks on a second thread; if none starts, this one does all */
            const Py_ssize_t half = (rows / 2 + BLOCK - 1) / BLOCK * BLOCK;
            Share second = {&e, x + half * features, rows - half, decisions + nodes * BLOCK, out + half * features};
            pthread_t thread;
            const int started = pthread_create(&thread, NULL, add_share, &second) == 0;
            add_rows(&e, x, half, decisions, out);
            if (started) {
                pthread_join(thread, NULL);
            } else {
                add_share(&second);
            }
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    free(decisions);
    for (int i = 0; i < B_COUNT; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"contributions", contributions, METH_VARARGS,
     "contributions(rows, features, nodes, leaves, paths, slots, table_size, x, node_feature, "
     "node_threshold, node_default_left, path_start, path_node, path_left, path_slot, slot_start, "
     "slot_feature, table_start, table, out): fill out (rows x features, float64) with TreeSHAP values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_treeshap",
                                    "Exact TreeSHAP from per-leaf tables (see treeshap.py).", -1, methods};

PyMODINIT_FUNC PyInit__treeshap(void) { return PyModule_Create(&module); }
