/* The compiled core of ngram_cache.py's NgramCountTable.update and .merge and of ngram_cache_draft: the same
 * counting over the same dicts, entry for entry and in the same insertion order, so a table counted or merged by
 * either is the same table, and the same walk over them. NgramCountTable.update_reference and .merge_reference and
 * ngram_cache_draft_reference are the pure-Python references the tests hold these to
 * (tests/unit/test_spec_ngram_core.py).
 *
 * Why C: counting runs for every prompt token as the target prefills it and for every emitted one, about four
 * n-grams each, and a finished sequence's table is merged into the dynamic one, on the round thread; interpreted,
 * they are most of a sequence's set-up and end. The walk runs for most sequences of every round, before its
 * decode: interpreted, a bytes slice and a look-up per n-gram size and a Python step per token were most of a
 * look-up.
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
 *
 * draft(context, dynamic, tail, n_history, n_draft)
 *   ngram_cache_draft's walk without a static table (its reference: ngram_cache_draft_reference): up to n_draft
 *   tokens, each the best token of the longest n-gram the context table holds with the lax thresholds, else of the
 *   dynamic table's (None: none) with the strict ones; stops at the first step where neither has one. tail: the
 *   history's last min(n_history, NGRAM_MAX) int32 tokens, as bytes. Returns a list of ints. The thresholds are
 *   this file's (RULES below), which ngram_cache.py checks against its own at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ISZ 4 /* bytes per token in keys (int32) */
#define NGRAM_MIN 1
#define NGRAM_MAX 4
#define TOKEN_NULL (-1)
/* thresholds by n-gram size 1..4 (llama.cpp draft_min_sample_size_* / draft_min_percent_*) */
static const long long MIN_SAMPLE_LAX[NGRAM_MAX] = {2, 2, 1, 1};
static const long long MIN_PERCENT_LAX[NGRAM_MAX] = {66, 50, 50, 50};
static const long long MIN_SAMPLE_STRICT[NGRAM_MAX] = {4, 3, 2, 2};
static const long long MIN_PERCENT_STRICT[NGRAM_MAX] = {75, 66, 66, 66};

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

/* _try_primary without a static part: *out = the best token of the longest n-gram ending the window whose entry
 * meets the thresholds, TOKEN_NULL where none does. Returns 0, or -1 with an exception set. */
static int try_primary(PyObject *table, const int32_t *window, Py_ssize_t avail, const long long *min_sample,
                       const long long *min_percent, long long *out) {
    *out = TOKEN_NULL;
    Py_ssize_t top = avail < NGRAM_MAX ? avail : NGRAM_MAX;
    for (Py_ssize_t size = top; size >= NGRAM_MIN; size--) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)(window + NGRAM_MAX - size), size * ISZ);
        if (key == NULL) return -1;
        PyObject *e = PyDict_GetItemWithError(table, key); /* borrowed */
        Py_DECREF(key);
        if (e == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        long long tot, best_c, best_t;
        if (PyLong_CheckExact(e)) { /* seen once: its one token */
            tot = best_c = 1;
            best_t = PyLong_AsLongLong(e);
            if (best_t == -1 && PyErr_Occurred()) return -1;
        } else if (PyDict_Check(e)) {
            if (get_ll(e, K_TOTAL, &tot) < 0 || get_ll(e, K_BEST_COUNT, &best_c) < 0 ||
                get_ll(e, K_BEST_TOKEN, &best_t) < 0)
                return -1;
        } else {
            PyErr_SetString(PyExc_TypeError, "ngram_cache draft: an entry that is neither an int nor a dict");
            return -1;
        }
        if (tot < min_sample[size - 1]) continue;
        if (100 * best_c < min_percent[size - 1] * tot) continue;
        *out = best_t;
        return 0;
    }
    return 0;
}

static PyObject *draft(PyObject *self, PyObject *args) {
    PyObject *ctx, *dyn;
    Py_buffer tail;
    Py_ssize_t n_history, n_draft;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!Oy*nn", &PyDict_Type, &ctx, &dyn, &tail, &n_history, &n_draft)) return NULL;
    Py_ssize_t n_tail = tail.len / ISZ;
    if (dyn != Py_None && !PyDict_Check(dyn)) {
        PyBuffer_Release(&tail);
        PyErr_SetString(PyExc_TypeError, "ngram_cache draft: the dynamic table must be a dict or None");
        return NULL;
    }
    if (tail.len % ISZ || n_tail > NGRAM_MAX || n_tail != (n_history < NGRAM_MAX ? n_history : NGRAM_MAX)) {
        PyBuffer_Release(&tail);
        PyErr_SetString(PyExc_ValueError, "ngram_cache draft: the tail must be the history's last min(n, 4) tokens");
        return NULL;
    }
    /* the window's last n_tail slots hold the tail; slots before it are never read (a key is at most avail long) */
    int32_t window[NGRAM_MAX] = {0};
    memcpy(window + NGRAM_MAX - n_tail, tail.buf, (size_t)tail.len);
    PyBuffer_Release(&tail);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n_draft; k++) {
        Py_ssize_t avail = n_history + k;
        long long tok;
        if (try_primary(ctx, window, avail, MIN_SAMPLE_LAX, MIN_PERCENT_LAX, &tok) < 0) goto fail;
        if (tok == TOKEN_NULL && dyn != Py_None &&
            try_primary(dyn, window, avail, MIN_SAMPLE_STRICT, MIN_PERCENT_STRICT, &tok) < 0)
            goto fail;
        if (tok == TOKEN_NULL) break;
        if (tok < INT32_MIN || tok > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "ngram_cache draft: a token out of int32 range");
            goto fail;
        }
        PyObject *t = PyLong_FromLongLong(tok);
        if (t == NULL) goto fail;
        int bad = PyList_Append(out, t) < 0;
        Py_DECREF(t);
        if (bad) goto fail;
        memmove(window, window + 1, (NGRAM_MAX - 1) * sizeof(int32_t));
        window[NGRAM_MAX - 1] = (int32_t)tok;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"update", update, METH_VARARGS,
     "update(table, data, lo, first, ngram_min, ngram_max): NgramCountTable.update_reference's loop, compiled"},
    {"merge", merge, METH_VARARGS,
     "merge(mine, theirs): NgramCountTable.merge_reference's loop, compiled (theirs is left as it was)"},
    {"draft", draft, METH_VARARGS,
     "draft(context, dynamic, tail, n_history, n_draft): ngram_cache_draft's walk without a static table, compiled"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ngram_core",
    "The compiled core of ngram_cache.py's NgramCountTable.update and .merge and of ngram_cache_draft.", -1, methods,
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
    PyObject *rules = Py_BuildValue("(ii(LLLL)(LLLL)(LLLL)(LLLL))", NGRAM_MIN, NGRAM_MAX, MIN_SAMPLE_LAX[0],
                                    MIN_SAMPLE_LAX[1], MIN_SAMPLE_LAX[2], MIN_SAMPLE_LAX[3], MIN_PERCENT_LAX[0],
                                    MIN_PERCENT_LAX[1], MIN_PERCENT_LAX[2], MIN_PERCENT_LAX[3], MIN_SAMPLE_STRICT[0],
                                    MIN_SAMPLE_STRICT[1], MIN_SAMPLE_STRICT[2], MIN_SAMPLE_STRICT[3],
                                    MIN_PERCENT_STRICT[0], MIN_PERCENT_STRICT[1], MIN_PERCENT_STRICT[2],
                                    MIN_PERCENT_STRICT[3]);
    if (rules == NULL || PyModule_AddObject(m, "RULES", rules) < 0) {
        Py_XDECREF(rules);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
