/* The compiled core of ngram_mod.py's NgramModPool.add_range and .roll: the same slots written with the same tokens,
 * in the same order, and the same count of slots newly used; the same draft rolled from the same window.
 * NgramModPool.add_range_reference (numpy) and .roll_reference (Python) are the references the tests hold these to
 * (tests/unit/test_spec_ngram_mod_core.py).
 *
 * Why C: a sequence's set-up adds every n-gram of its prompt to the pool, on the round thread. The numpy version
 * hashes each window afresh (n products a window), sorts the slots to keep each one's last write, and gathers and
 * scatters through index arrays; a rolling hash in one pass does a product or two a token and writes in place. A
 * look-up hashes the history's last n tokens and rolls the hash a token at a time: interpreted, with Python's
 * big integers and a numpy scalar read a step, and the window's hash kept up to date token by token between
 * look-ups, it cost more than the rest of the look-up.
 *
 * add(entries, tokens, start, stop, n) -> newly used
 *   entries: the pool (a writable int32 buffer, -1 = empty); tokens: an int32 buffer. For i in [start, stop) in
 *   order, with stop <= len(tokens) - n: entries[hash(tokens[i:i+n]) % len(entries)] = tokens[i+n], where
 *   hash(w) = sum_j w[j] * C**(n-1-j) mod 2**64 (ngram_mod.py's HASH_MUL; a token is taken as a signed 64-bit
 *   integer, as numpy's int32 -> uint64 cast and Python's masked arithmetic take it). Returns how many of the
 *   written slots were empty before the call.
 *
 * roll(entries, window, limit, n_min) -> list of ints
 *   From hash(window) (n = len(window)): up to `limit` tokens, each the pool's token at the current window's slot,
 *   the window then shifted by it; a slot left empty ends the draft, and voids it ([]) before n_min tokens.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define HASH_MUL 6364136223846793005ULL
#define EMPTY (-1)

/* both buffers int32 (a TypeError naming them else) */
static int int32_buffers(Py_buffer *a, Py_buffer *b, const char *names) {
    if (a->itemsize == sizeof(int32_t) && b->itemsize == sizeof(int32_t)) return 0;
    PyErr_Format(PyExc_TypeError, "ngram_mod core: %s must be int32 buffers", names);
    return -1;
}

/* hash(w[0:n]) by Horner's rule, and C**(n-1), the weight of the token that leaves the window when it rolls */
static uint64_t window_hash(const int32_t *w, Py_ssize_t n, uint64_t *top) {
    uint64_t h = 0;
    *top = 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        h = h * HASH_MUL + (uint64_t)(int64_t)w[j];
        if (j + 1 < n) *top *= HASH_MUL;
    }
    return h;
}

/* the hash of the window shifted by one token: `leaving` goes, `entering` comes */
static uint64_t rolled(uint64_t h, int32_t leaving, int32_t entering, uint64_t top) {
    return (h - (uint64_t)(int64_t)leaving * top) * HASH_MUL + (uint64_t)(int64_t)entering;
}

static PyObject *add(PyObject *self, PyObject *args) {
    Py_buffer entries, tokens;
    Py_ssize_t start, stop, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*nnn", &entries, &tokens, &start, &stop, &n)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t size = entries.len / (Py_ssize_t)sizeof(int32_t);
    Py_ssize_t len = tokens.len / (Py_ssize_t)sizeof(int32_t);
    if (int32_buffers(&entries, &tokens, "entries and tokens") < 0) goto done;
    if (n < 1 || size < 1 || start < 0 || stop > len - n) {
        PyErr_SetString(PyExc_ValueError, "ngram_mod core: n >= 1, a pool, 0 <= start and stop <= len(tokens) - n");
        goto done;
    }
    int32_t *e = (int32_t *)entries.buf;
    const int32_t *t = (const int32_t *)tokens.buf;
    long long used = 0;
    if (start < stop) {
        uint64_t top, h = window_hash(t + start, n, &top);
        const uint64_t usize = (uint64_t)size;
        for (Py_ssize_t i = start;; i++) {
            int32_t *slot = e + (h % usize);
            used += *slot == EMPTY;
            *slot = t[i + n];
            if (i + 1 == stop) break;
            h = rolled(h, t[i], t[i + n], top);
        }
    }
    result = PyLong_FromLongLong(used);
done:
    PyBuffer_Release(&entries);
    PyBuffer_Release(&tokens);
    return result;
}

static PyObject *roll(PyObject *self, PyObject *args) {
    Py_buffer entries, window;
    Py_ssize_t limit, n_min;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nn", &entries, &window, &limit, &n_min)) return NULL;
    PyObject *out = NULL;
    int32_t *drafted = NULL;
    Py_ssize_t size = entries.len / (Py_ssize_t)sizeof(int32_t);
    Py_ssize_t n = window.len / (Py_ssize_t)sizeof(int32_t);
    if (int32_buffers(&entries, &window, "entries and window") < 0) goto done;
    if (n < 1 || size < 1) {
        PyErr_SetString(PyExc_ValueError, "ngram_mod core: a window of at least one token and a pool");
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL || limit <= 0) goto done;
    const int32_t *e = (const int32_t *)entries.buf;
    const int32_t *w = (const int32_t *)window.buf;
    uint64_t top, h = window_hash(w, n, &top);
    const uint64_t usize = (uint64_t)size;
    if (e[h % usize] == EMPTY) goto done; /* the common case: no draft */
    drafted = PyMem_Malloc((size_t)limit * sizeof(int32_t));
    if (drafted == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k = 0;
    for (; k < limit; k++) {
        int32_t tok = e[h % usize];
        if (tok == EMPTY) break;
        drafted[k] = tok;
        /* the window's first token leaves, then the drafted ones */
        h = rolled(h, k < n ? w[k] : drafted[k - n], tok, top);
    }
    if (k < limit && k < n_min) goto done; /* a miss before n_min tokens: no draft */
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *o = PyLong_FromLong(drafted[j]);
        if (o == NULL || PyList_Append(out, o) < 0) {
            Py_XDECREF(o);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(o);
    }
done:
    PyMem_Free(drafted);
    PyBuffer_Release(&entries);
    PyBuffer_Release(&window);
    return out;
}

static PyMethodDef methods[] = {
    {"add", add, METH_VARARGS,
     "add(entries, tokens, start, stop, n) -> newly used: NgramModPool.add_range_reference's writes, compiled"},
    {"roll", roll, METH_VARARGS,
     "roll(entries, window, limit, n_min) -> list: NgramModPool.roll_reference's draft, compiled"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ngram_mod_core",
                                    "The compiled core of ngram_mod.py's NgramModPool.add_range and .roll.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ngram_mod_core(void) { return PyModule_Create(&module); }
