/* The compiled core of ngram_cache.py's NgramCountTable.update and .merge: the same counting over the same dicts,
 * entry for entry and in the same insertion order, so a table counted or merged by either is the same table.
 * NgramCountTable.update_reference and .merge_reference are the pure-Python references the tests hold these to
 * (tests/unit/test_spec_ngram_core.py).
 *
 * Why C: counting runs for every prompt token as the target prefills it and for every emitted one, about four
 * n-grams each, and a finished sequence's table is merged into the dynamic one, on the round thread; interpreted,
 * they are most of a sequence's set-up and end.
 *
 * update(table, data, lo, first, ngram_min, ngram_max)
 *   table: {n-gram bytes: entry}; data: the int32 tokens from position lo on, as bytes. Counts
 *   (tokens[i-s:i] -> tokens[i]) for every i in [first, lo + len(data) / 4) and s in [ngram_min, min(ngram_max, i)],
 *   where first >= lo + ngram_max or first - lo >= s for every s counted (the caller's lo = first - ngram_max,
 *   clipped at 0). An entry is the int of the one token that followed an n-gram seen once, else a dict: the next
 *   tokens' counts under their ids, and under TOTAL, BEST_COUNT and BEST_TOKEN (negative keys) its summary.
 *
 * merge(mine, theirs)
 *   adds every entry of `theirs` into `mine`; an entry `mine` lacks is taken as it is (the caller drops `theirs`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ISZ 4 /* bytes per token in keys (int32) */

/* ngram_cache.py's _TOTAL, _BEST_COUNT, _BEST_TOKEN */
static PyObject *K_TOTAL, *K_BEST_COUNT, *K_BEST_TOKEN;

static int set_ll(PyObject *d, PyObject *k, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    int r = PyDict_SetItem(d, k, o);
    Py_DECREF(o);
    return r;
}

static int get_ll(PyObject *d, PyObject *k, long long *out) {
    PyObject *o = PyDict_GetItemWithError(d, k);
    if (o == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "ngram_cache: an entry without its summary");
        return -1;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* _grown(e, tok): a once-seen entry (the token `e`) after one more occurrence followed by `tok`; a new dict with
 * the keys in _grown's order. */
static PyObject *grown(PyObject *e, PyObject *tok) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    int eq = PyObject_RichCompareBool(e, tok, Py_EQ);
    if (eq < 0) goto fail;
    if (eq) {
        if (set_ll(d, e, 2) < 0 || set_ll(d, K_TOTAL, 2) < 0 || set_ll(d, K_BEST_COUNT, 2) < 0 ||
            PyDict_SetItem(d, K_BEST_TOKEN, e) < 0)
            goto fail;
    } else {
        if (set_ll(d, e, 1) < 0 || set_ll(d, tok, 1) < 0 || set_ll(d, K_TOTAL, 2) < 0 ||
            set_ll(d, K_BEST_COUNT, 1) < 0 || PyDict_SetItem(d, K_BEST_TOKEN, e) < 0)
            goto fail;
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* one more occurrence of a dict entry, followed by `tok` (add()'s rule: a token leads once its count beats the
 * leader's) */
static int counted(PyObject *e, PyObject *tok) {
    long long c = 0, total, best;
    PyObject *o = PyDict_GetItemWithError(e, tok);
    if (o != NULL) {
        c = PyLong_AsLongLong(o);
        if (c == -1 && PyErr_Occurred()) return -1;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    c += 1;
    if (set_ll(e, tok, c) < 0 || get_ll(e, K_TOTAL, &total) < 0 || set_ll(e, K_TOTAL, total + 1) < 0 ||
        get_ll(e, K_BEST_COUNT, &best) < 0)
        return -1;
    if (c > best) {
        if (set_ll(e, K_BEST_COUNT, c) < 0 || PyDict_SetItem(e, K_BEST_TOKEN, tok) < 0) return -1;
    }
    return 0;
}

static PyObject *update(PyObject *self, PyObject *args) {
    PyObject *table;
    Py_buffer data;
    Py_ssize_t lo, first, nmin, nmax;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!y*nnnn", &PyDict_Type, &table, &data, &lo, &first, &nmin, &nmax)) return NULL;
    const char *buf = (const char *)data.buf;
    Py_ssize_t n = data.len / ISZ, L = lo + n;
    if (data.len % ISZ || lo < 0 || nmin < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "ngram_cache update: bad arguments");
        return NULL;
    }
    if (first < nmin) first = nmin;
    for (Py_ssize_t i = first; i < L; i++) {
        Py_ssize_t r = i - lo, end = r * ISZ;
        int32_t tv;
        memcpy(&tv, buf + end, ISZ);
        PyObject *tok = PyLong_FromLong(tv);
        if (tok == NULL) goto fail;
        Py_ssize_t smax = nmax < i ? nmax : i;
        for (Py_ssize_t s = nmin; s <= smax; s++) {
            if (s > r) { /* the n-gram would start before lo: the caller's slice is too short */
                Py_DECREF(tok);
                PyErr_SetString(PyExc_ValueError, "ngram_cache update: the data starts too late");
                goto fail;
            }
            PyObject *key = PyBytes_FromStringAndSize(buf + end - s * ISZ, s * ISZ);
            if (key == NULL) {
                Py_DECREF(tok);
                goto fail;
            }
            PyObject *e = PyDict_GetItemWithError(table, key); /* borrowed */
            int bad;
            if (e == NULL) {
                bad = PyErr_Occurred() != NULL || PyDict_SetItem(table, key, tok) < 0;
            } else if (PyLong_CheckExact(e)) {
                PyObject *d = grown(e, tok);
                bad = d == NULL || PyDict_SetItem(table, key, d) < 0;
                Py_XDECREF(d);
            } else {
                bad = counted(e, tok) < 0;
            }
            Py_DECREF(key);
            if (bad) {
                Py_DECREF(tok);
                goto fail;
            }
        }
        Py_DECREF(tok);
    }
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&data);
    return NULL;
}

/* _entry(token, count): a dict entry with one next token */
static PyObject *entry(PyObject *tok, long long count) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (set_ll(d, tok, count) < 0 || set_ll(d, K_TOTAL, count) < 0 || set_ll(d, K_BEST_COUNT, count) < 0 ||
        PyDict_SetItem(d, K_BEST_TOKEN, tok) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* a dict entry `e` of `theirs` into `m` of `mine` (merge()'s loop body for two dicts) */
static int merge_dicts(PyObject *m, PyObject *e) {
    long long best, total, etotal;
    if (get_ll(m, K_BEST_COUNT, &best) < 0) return -1;
    PyObject *tok, *cnt;
    Py_ssize_t pos = 0;
    while (PyDict_Next(e, &pos, &tok, &cnt)) {
        long long t = PyLong_AsLongLong(tok);
        if (t == -1 && PyErr_Occurred()) return -1;
        if (t < 0) continue;
        long long c = PyLong_AsLongLong(cnt);
        if (c == -1 && PyErr_Occurred()) return -1;
        PyObject *have = PyDict_GetItemWithError(m, tok);
        if (have != NULL) {
            long long h = PyLong_AsLongLong(have);
            if (h == -1 && PyErr_Occurred()) return -1;
            c += h;
        } else if (PyErr_Occurred()) {
            return -1;
        }
        if (set_ll(m, tok, c) < 0) return -1;
        if (c > best) {
            best = c;
            if (PyDict_SetItem(m, K_BEST_TOKEN, tok) < 0) return -1;
        }
    }
    if (get_ll(m, K_TOTAL, &total) < 0 || get_ll(e, K_TOTAL, &etotal) < 0 || set_ll(m, K_TOTAL, total + etotal) < 0 ||
        set_ll(m, K_BEST_COUNT, best) < 0)
        return -1;
    return 0;
}

static PyObject *merge(PyObject *self, PyObject *args) {
    PyObject *mine, *theirs;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &mine, &PyDict_Type, &theirs)) return NULL;
    if (mine == theirs) {
        PyErr_SetString(PyExc_ValueError, "ngram_cache merge: a table into itself");
        return NULL;
    }
    PyObject *key, *e;
    Py_ssize_t pos = 0;
    while (PyDict_Next(theirs, &pos, &key, &e)) {
        PyObject *m = PyDict_GetItemWithError(mine, key); /* borrowed */
        if (m == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(mine, key, e) < 0) return NULL;
            continue;
        }
        if (PyLong_CheckExact(e)) {
            if (PyLong_CheckExact(m)) {
                PyObject *d = grown(m, e);
                int bad = d == NULL || PyDict_SetItem(mine, key, d) < 0;
                Py_XDECREF(d);
                if (bad) return NULL;
            } else if (counted(m, e) < 0) {
                return NULL;
            }
            continue;
        }
        if (PyLong_CheckExact(m)) {
            PyObject *d = entry(m, 1);
            int bad = d == NULL || PyDict_SetItem(mine, key, d) < 0;
            Py_XDECREF(d);
            if (bad) return NULL;
            m = d; /* mine holds it */
        }
        if (merge_dicts(m, e) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"update", update, METH_VARARGS,
     "update(table, data, lo, first, ngram_min, ngram_max): NgramCountTable.update_reference's loop, compiled"},
    {"merge", merge, METH_VARARGS,
     "merge(mine, theirs): NgramCountTable.merge_reference's loop, compiled (theirs is left as it was)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ngram_core",
                                    "The compiled core of ngram_cache.py's NgramCountTable.update and .merge.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ngram_core(void) {
    K_TOTAL = PyLong_FromLong(-2);
    K_BEST_COUNT = PyLong_FromLong(-3);
    K_BEST_TOKEN = PyLong_FromLong(-4);
    if (K_TOTAL == NULL || K_BEST_COUNT == NULL || K_BEST_TOKEN == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* ngram_cache.py checks these against its own at import */
    PyObject *keys = PyTuple_Pack(3, K_TOTAL, K_BEST_COUNT, K_BEST_TOKEN);
    if (keys == NULL || PyModule_AddObject(m, "SUMMARY_KEYS", keys) < 0) {
        Py_XDECREF(keys);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
