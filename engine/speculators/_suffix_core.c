/* The compiled core of suffix.py's SuffixTrie.extend and .advance_through and of SuffixSpeculator's pick: the same
 * algorithms over the same Python lists and dicts, step for step, so a trie grown by either is the same trie, a
 * context matched by either has the same states and a look-up picks the same walk. SuffixTrie.extend_reference and
 * .advance_through_reference and SuffixSpeculator._pick_reference are the pure-Python references the tests hold
 * these to (tests/unit/test_spec_suffix_core.py).
 *
 * Why C: extending runs for every prompt token as the target prefills it and for every emitted token, on the
 * round thread, and costs O(suffixes ending at the token that occur twice or more) steps, up to max_depth each;
 * interpreted, those steps are most of a prompt's set-up. Advancing a sequence's matches in the global trie runs
 * for every emitted token, and for the last max_depth tokens of every running sequence each time the global
 * trie gains or loses a sequence: interpreted, those re-matches were most of the look-up of the round after.
 * Every look-up then picks its walk among all the sequence's matches in both tries, up to max_depth of each:
 * interpreted, that scan was most of a look-up where the text repeats.
 *
 * extend(seq, act, tokens, base, max_depth, seqs, actives, cnt, best, bestc, one, kids_of, free, rescan) -> act
 *   seq: the sequence's token list (appended to); act: its growing suffixes' node indices before the tokens;
 *   base: sid << 32 (a leaf of this sequence at position p is base | p); seqs, actives: the trie's sequences
 *   and growing-suffix lists by sid; cnt .. kids_of: the node fields; free: node indices to reuse; rescan: the
 *   trie's _rescan(i) (a node's stale best child, after a removal). Returns the new growing-suffix list.
 *
 * advance(states, tokens, max_depth, seqs, best, one, kids_of) -> states
 *   SuffixTrie.advance for each token in turn: states[i] is the reference of the matched context's suffix of
 *   length i + 1 (a node ~i, or a leaf sid << 32 | pos); returns the states after the last token.
 *
 * draft(active, own_fields, gstates, global_fields, n_max, min_match, p_min, factor, offset) -> None or
 *       (tokens, probs, score, match_len, from_global, state, budget)
 *   suffix_draft over the candidates of one sequence, in its order: its own trie's growing suffixes (active: node
 *   indices, match length i + 1) and then its states in the global trie (gstates, match length i + 1), with
 *   SuffixTrie.walk for each walk it makes; *_fields: SuffixTrie.core_fields() of each trie.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define SHIFT 32
#define POS ((1LL << SHIFT) - 1)

typedef struct {
    PyObject *cnt, *best, *bestc, *one, *kids_of, *free;
} Nodes;

static int get_ll(PyObject *list, Py_ssize_t i, long long *out) {
    long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static int set_ll(PyObject *list, Py_ssize_t i, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    return PyList_SetItem(list, i, o); /* steals o, releases the old item */
}

static int set_obj(PyObject *list, Py_ssize_t i, PyObject *o) {
    Py_INCREF(o);
    return PyList_SetItem(list, i, o);
}

static int check_index(PyObject *list, Py_ssize_t i) {
    if (i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_Format(PyExc_IndexError, "suffix trie node %zd out of range", i);
        return -1;
    }
    return 0;
}

/* _new(count): a node with `count` occurrences and no children; returns its index (the caller takes ~index). */
static Py_ssize_t new_node(Nodes *n, long long count) {
    Py_ssize_t nf = PyList_GET_SIZE(n->free);
    if (nf > 0) {
        long long i;
        if (get_ll(n->free, nf - 1, &i) < 0) return -1;
        if (PyList_SetSlice(n->free, nf - 1, nf, NULL) < 0) return -1;
        if (check_index(n->cnt, (Py_ssize_t)i) < 0) return -1;
        if (set_ll(n->cnt, i, count) < 0 || set_ll(n->best, i, -1) < 0 || set_ll(n->bestc, i, 0) < 0 ||
            set_obj(n->one, i, Py_None) < 0 || set_obj(n->kids_of, i, Py_None) < 0)
            return -1;
        return (Py_ssize_t)i;
    }
    Py_ssize_t i = PyList_GET_SIZE(n->cnt);
    PyObject *c = PyLong_FromLongLong(count), *m1 = PyLong_FromLong(-1), *z = PyLong_FromLong(0);
    int bad = c == NULL || m1 == NULL || z == NULL || PyList_Append(n->cnt, c) < 0 || PyList_Append(n->best, m1) < 0 ||
              PyList_Append(n->bestc, z) < 0 || PyList_Append(n->one, Py_None) < 0 ||
              PyList_Append(n->kids_of, Py_None) < 0;
    Py_XDECREF(c);
    Py_XDECREF(m1);
    Py_XDECREF(z);
    return bad ? -1 : i;
}

/* _put_new(i, t, ch, c): add child t (not a child yet) with reference ch and count c to node i. */
static int put_new(Nodes *n, Py_ssize_t i, PyObject *t, PyObject *ch, long long c) {
    PyObject *kids = PyList_GET_ITEM(n->kids_of, i);
    if (kids == Py_None) {
        PyObject *one = PyList_GET_ITEM(n->one, i);
        if (one == Py_None) {
            if (set_obj(n->one, i, ch) < 0 || set_obj(n->best, i, t) < 0 || set_ll(n->bestc, i, c) < 0) return -1;
            return 0;
        }
        kids = PyDict_New();
        if (kids == NULL) return -1;
        if (PyDict_SetItem(kids, PyList_GET_ITEM(n->best, i), one) < 0) {
            Py_DECREF(kids);
            return -1;
        }
        if (PyList_SetItem(n->kids_of, i, kids) < 0) return -1; /* steals kids */
        if (set_obj(n->one, i, Py_None) < 0) return -1;
    }
    if (PyDict_SetItem(kids, t, ch) < 0) return -1;
    long long bc;
    if (get_ll(n->bestc, i, &bc) < 0) return -1;
    if (c > bc && bc >= 0) {
        if (set_obj(n->best, i, t) < 0 || set_ll(n->bestc, i, c) < 0) return -1;
    }
    return 0;
}

/* One token: the body of SuffixTrie.extend_reference's loop. `act` is this token's starting list; returns the
 * new one (a new reference). */
static PyObject *extend_one(Nodes *n, PyObject *seq, PyObject *act, PyObject *t, long long tv, long long base,
                            long long D, PyObject *seqs, PyObject *actives, PyObject *rescan) {
    Py_ssize_t cur = PyList_GET_SIZE(seq);
    if (PyList_Append(seq, t) < 0) return NULL;
    long long c0;
    if (get_ll(n->cnt, 0, &c0) < 0 || set_ll(n->cnt, 0, c0 + 1) < 0) return NULL;
    PyObject *newl = PyList_New(0);
    if (newl == NULL) return NULL;
    Py_ssize_t node = 0, i = 0, n_act = PyList_GET_SIZE(act);
    for (;;) {
        if (check_index(n->kids_of, node) < 0) goto fail;
        PyObject *kids = PyList_GET_ITEM(n->kids_of, node);
        PyObject *ch; /* borrowed, or NULL: no child t */
        if (kids == Py_None) {
            long long b;
            if (get_ll(n->best, node, &b) < 0) goto fail;
            ch = b == tv ? PyList_GET_ITEM(n->one, node) : NULL;
            if (ch == Py_None) ch = NULL;
        } else {
            ch = PyDict_GetItemWithError(kids, t);
            if (ch == NULL && PyErr_Occurred()) goto fail;
        }
        if (ch == NULL) { /* the string is new here, hence also for every longer suffix */
            PyObject *leaf = PyLong_FromLongLong(base | (long long)cur);
            if (leaf == NULL) goto fail;
            for (;;) {
                if (put_new(n, node, t, leaf, 1) < 0) {
                    Py_DECREF(leaf);
                    goto fail;
                }
                if (i >= n_act) break;
                long long a;
                if (get_ll(act, i, &a) < 0) {
                    Py_DECREF(leaf);
                    goto fail;
                }
                node = (Py_ssize_t)a;
                i++;
                if (check_index(n->kids_of, node) < 0) {
                    Py_DECREF(leaf);
                    goto fail;
                }
            }
            Py_DECREF(leaf);
            break;
        }
        long long chv = PyLong_AsLongLong(ch);
        if (chv == -1 && PyErr_Occurred()) goto fail;
        long long j, c;
        if (chv < 0) {
            j = ~chv;
            if (check_index(n->cnt, (Py_ssize_t)j) < 0 || get_ll(n->cnt, j, &c) < 0) goto fail;
            c += 1;
            if (set_ll(n->cnt, j, c) < 0) goto fail;
        } else { /* split a leaf: its occurrence and ours */
            long long q = chv & POS, sid2 = chv >> SHIFT;
            PyObject *k2 = PyLong_FromLongLong(sid2);
            if (k2 == NULL) goto fail;
            PyObject *seq2 = PyDict_GetItemWithError(seqs, k2);
            if (seq2 == NULL || !PyList_Check(seq2)) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "suffix trie: no sequence %lld", sid2);
                Py_DECREF(k2);
                goto fail;
            }
            Py_INCREF(seq2); /* new_node may run Python code (freeing), keep it alive */
            Py_ssize_t mi = new_node(n, 2);
            if (mi < 0) {
                Py_DECREF(seq2);
                Py_DECREF(k2);
                goto fail;
            }
            j = mi;
            int err = 0;
            if (q + 1 < PyList_GET_SIZE(seq2)) {
                if (i + 2 <= D) {
                    err = set_ll(n->one, j, chv + 1) < 0 || set_obj(n->best, j, PyList_GET_ITEM(seq2, q + 1)) < 0 ||
                          set_ll(n->bestc, j, 1) < 0;
                }
            } else if (i + 1 < D) {
                /* the leaf was the growing end of another (unfinished) sequence: that suffix is now explicit
                 * and must grow with its sequence */
                PyObject *act2 = PyDict_GetItemWithError(actives, k2);
                if (act2 == NULL) {
                    err = PyErr_Occurred() != NULL;
                } else if (PyList_GET_SIZE(act2) == i) {
                    PyObject *jo = PyLong_FromLongLong(j);
                    err = jo == NULL || PyList_Append(act2, jo) < 0;
                    Py_XDECREF(jo);
                }
            }
            Py_DECREF(seq2);
            Py_DECREF(k2);
            if (err) goto fail;
            PyObject *m = PyLong_FromLongLong(~j);
            if (m == NULL) goto fail;
            if (kids == Py_None) {
                err = PyList_SetItem(n->one, node, m) < 0; /* steals m */
            } else {
                err = PyDict_SetItem(kids, t, m) < 0;
                Py_DECREF(m);
            }
            if (err) goto fail;
            c = 2;
        }
        long long bc;
        if (get_ll(n->bestc, node, &bc) < 0) goto fail;
        if (c > bc) {
            if (bc < 0) {
                PyObject *r = PyObject_CallFunction(rescan, "n", node);
                if (r == NULL) goto fail;
                Py_DECREF(r);
            } else if (set_obj(n->best, node, t) < 0 || set_ll(n->bestc, node, c) < 0) {
                goto fail;
            }
        }
        PyObject *jo = PyLong_FromLongLong(j);
        if (jo == NULL) goto fail;
        int bad = PyList_Append(newl, jo) < 0;
        Py_DECREF(jo);
        if (bad) goto fail;
        if (i >= n_act) break;
        long long a;
        if (get_ll(act, i, &a) < 0) goto fail;
        node = (Py_ssize_t)a;
        i++;
    }
    if (PyList_GET_SIZE(newl) >= D && PyList_SetSlice(newl, D - 1, PyList_GET_SIZE(newl), NULL) < 0) goto fail;
    return newl;
fail:
    Py_DECREF(newl);
    return NULL;
}

/* The next token of an iterator over ints (numpy integers too: int(t)): 1 with *t (a new reference) and its value
 * *tv, 0 at the end, -1 with an exception set. */
static int next_token(PyObject *it, PyObject **t, long long *tv) {
    PyObject *tok = PyIter_Next(it);
    if (tok == NULL) return PyErr_Occurred() ? -1 : 0;
    *t = PyNumber_Index(tok);
    Py_DECREF(tok);
    if (*t == NULL) return -1;
    *tv = PyLong_AsLongLong(*t);
    if (*tv == -1 && PyErr_Occurred()) {
        Py_CLEAR(*t);
        return -1;
    }
    return 1;
}

static PyObject *extend(PyObject *self, PyObject *args) {
    PyObject *seq, *act, *tokens, *seqs, *actives, *rescan;
    long long base, D;
    Nodes n;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!OLLO!O!O!O!O!O!O!O!O", &PyList_Type, &seq, &PyList_Type, &act, &tokens, &base,
                          &D, &PyDict_Type, &seqs, &PyDict_Type, &actives, &PyList_Type, &n.cnt, &PyList_Type,
                          &n.best, &PyList_Type, &n.bestc, &PyList_Type, &n.one, &PyList_Type, &n.kids_of,
                          &PyList_Type, &n.free, &rescan))
        return NULL;
    PyObject *it = PyObject_GetIter(tokens);
    if (it == NULL) return NULL;
    Py_INCREF(act);
    PyObject *t;
    long long tv;
    int more;
    while ((more = next_token(it, &t, &tv)) > 0) {
        PyObject *next = extend_one(&n, seq, act, t, tv, base, D, seqs, actives, rescan);
        Py_DECREF(t);
        if (next == NULL) goto fail;
        Py_DECREF(act);
        act = next;
    }
    if (more < 0) goto fail;
    Py_DECREF(it);
    return act;
fail:
    Py_DECREF(it);
    Py_DECREF(act);
    return NULL;
}

/* _child(i, t): node i's child for token t (a new reference), or NULL without an exception where it has none */
static PyObject *child(PyObject *best, PyObject *one, PyObject *kids_of, Py_ssize_t i, PyObject *t, long long tv) {
    if (check_index(kids_of, i) < 0 || check_index(best, i) < 0 || check_index(one, i) < 0) return NULL;
    PyObject *kids = PyList_GET_ITEM(kids_of, i);
    if (kids == Py_None) {
        long long b;
        if (get_ll(best, i, &b) < 0) return NULL;
        PyObject *o = PyList_GET_ITEM(one, i);
        if (b != tv || o == Py_None) return NULL;
        Py_INCREF(o);
        return o;
    }
    if (!PyDict_CheckExact(kids)) {
        PyErr_Format(PyExc_TypeError, "suffix trie node %zd: children that are not a dict", i);
        return NULL;
    }
    PyObject *o = PyDict_GetItemWithError(kids, t);
    Py_XINCREF(o);
    return o;
}

/* SuffixTrie.advance(states, t) */
static PyObject *advance_one(PyObject *states, PyObject *t, long long tv, long long D, PyObject *seqs, PyObject *best,
                             PyObject *one, PyObject *kids_of) {
    PyObject *ch = child(best, one, kids_of, 0, t, tv);
    if (ch == NULL) return PyErr_Occurred() ? NULL : PyList_New(0);
    PyObject *out = PyList_New(1);
    if (out == NULL) {
        Py_DECREF(ch);
        return NULL;
    }
    PyList_SET_ITEM(out, 0, ch); /* steals ch */
    /* states[: max_depth - 1], as Python slices it (a max_depth below 1 counts from the end) */
    Py_ssize_t n = PyList_GET_SIZE(states), lim = D - 1 < n ? (Py_ssize_t)(D - 1) : n;
    if (lim < 0) lim = lim + n > 0 ? lim + n : 0;
    for (Py_ssize_t k = 0; k < lim; k++) {
        long long obj;
        if (get_ll(states, k, &obj) < 0) goto fail;
        if (obj < 0) {
            ch = child(best, one, kids_of, (Py_ssize_t)~obj, t, tv);
            if (ch == NULL) {
                if (PyErr_Occurred()) goto fail;
                break;
            }
            int bad = PyList_Append(out, ch) < 0;
            Py_DECREF(ch);
            if (bad) goto fail;
        } else {
            long long pos = obj & POS;
            PyObject *sid = PyLong_FromLongLong(obj >> SHIFT);
            if (sid == NULL) goto fail;
            PyObject *seq = PyDict_GetItemWithError(seqs, sid); /* borrowed */
            Py_DECREF(sid);
            if (seq == NULL) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "suffix trie: no sequence %lld", obj >> SHIFT);
                goto fail;
            }
            if (!PyList_CheckExact(seq)) {
                PyErr_SetString(PyExc_TypeError, "suffix trie: a sequence that is not a list");
                goto fail;
            }
            long long next;
            if (pos + 1 >= PyList_GET_SIZE(seq)) break;
            if (get_ll(seq, (Py_ssize_t)(pos + 1), &next) < 0) goto fail;
            if (next != tv) break;
            PyObject *o = PyLong_FromLongLong(obj + 1);
            if (o == NULL) goto fail;
            int bad = PyList_Append(out, o) < 0;
            Py_DECREF(o);
            if (bad) goto fail;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *advance(PyObject *self, PyObject *args) {
    PyObject *states, *tokens, *seqs, *best, *one, *kids_of;
    long long D;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OLO!O!O!O!", &PyList_Type, &states, &tokens, &D, &PyDict_Type, &seqs,
                          &PyList_Type, &best, &PyList_Type, &one, &PyList_Type, &kids_of))
        return NULL;
    PyObject *it = PyObject_GetIter(tokens);
    if (it == NULL) return NULL;
    Py_INCREF(states);
    PyObject *t;
    long long tv;
    int more;
    while ((more = next_token(it, &t, &tv)) > 0) {
        PyObject *next = advance_one(states, t, tv, D, seqs, best, one, kids_of);
        Py_DECREF(t);
        if (next == NULL) goto fail;
        Py_DECREF(states);
        states = next;
    }
    if (more < 0) goto fail;
    Py_DECREF(it);
    return states;
fail:
    Py_DECREF(it);
    Py_DECREF(states);
    return NULL;
}

/* ---- draft: suffix_draft over a sequence's candidates in its own trie and the global one, with their walks ---- */

typedef struct {
    PyObject *cnt, *best, *bestc, *one, *kids, *seqs, *rescan;
    long long D;
} Trie;

static int read_trie(PyObject *fields, Trie *t) {
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != 8) {
        PyErr_SetString(PyExc_TypeError, "suffix core draft: a trie's fields are SuffixTrie.core_fields()");
        return -1;
    }
    t->cnt = PyTuple_GET_ITEM(fields, 0);
    t->best = PyTuple_GET_ITEM(fields, 1);
    t->bestc = PyTuple_GET_ITEM(fields, 2);
    t->one = PyTuple_GET_ITEM(fields, 3);
    t->kids = PyTuple_GET_ITEM(fields, 4);
    t->seqs = PyTuple_GET_ITEM(fields, 5);
    t->rescan = PyTuple_GET_ITEM(fields, 7);
    t->D = PyLong_AsLongLong(PyTuple_GET_ITEM(fields, 6));
    if (t->D == -1 && PyErr_Occurred()) return -1;
    if (!PyList_Check(t->cnt) || !PyList_Check(t->best) || !PyList_Check(t->bestc) || !PyList_Check(t->one) ||
        !PyList_Check(t->kids) || !PyDict_Check(t->seqs) || !PyCallable_Check(t->rescan)) {
        PyErr_SetString(PyExc_TypeError, "suffix core draft: a trie's fields are SuffixTrie.core_fields()");
        return -1;
    }
    return 0;
}

static int node_ll(PyObject *list, long long i, long long *out) {
    if (check_index(list, (Py_ssize_t)i) < 0) return -1;
    return get_ll(list, (Py_ssize_t)i, out);
}

/* SuffixTrie.count_of */
static int count_of(Trie *t, long long ref, long long *out) {
    if (ref >= 0) {
        *out = 1;
        return 0;
    }
    return node_ll(t->cnt, ~ref, out);
}

/* node i's best child's count, rescanned (SuffixTrie._rescan) where it is stale, as best_of and walk do */
static int fresh_bestc(Trie *t, long long i, long long *bc) {
    if (node_ll(t->bestc, i, bc) < 0) return -1;
    if (*bc < 0) {
        PyObject *r = PyObject_CallFunction(t->rescan, "L", i);
        if (r == NULL) return -1;
        Py_DECREF(r);
        if (node_ll(t->bestc, i, bc) < 0) return -1;
    }
    return 0;
}

static int append_ll(PyObject *list, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

static int append_double(PyObject *list, double v) {
    PyObject *o = PyFloat_FromDouble(v);
    if (o == NULL) return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

/* SuffixTrie.walk: the greedy most-frequent-child path from `obj` at depth k into toks and probs */
static int walk(Trie *t, long long k, long long obj, long long budget, double p_min, PyObject *toks, PyObject *probs) {
    double prob = 1.0;
    long long depth = k;
    while (PyList_GET_SIZE(toks) < budget && depth < t->D) {
        if (obj < 0) {
            long long i = ~obj, c, bc, tok;
            if (node_ll(t->cnt, i, &c) < 0) return -1;
            if (c <= 0) break; /* taken out by a removal a state made before it still names */
            if (node_ll(t->bestc, i, &bc) < 0) return -1;
            if (bc <= 0) {
                if (bc == 0 || fresh_bestc(t, i, &bc) < 0 || bc == 0) {
                    if (PyErr_Occurred()) return -1;
                    break;
                }
            }
            prob *= (double)bc / (double)c;
            if (prob < p_min) break;
            if (node_ll(t->best, i, &tok) < 0 || append_ll(toks, tok) < 0 || append_double(probs, prob) < 0)
                return -1;
            depth++;
            PyObject *kids = PyList_GET_ITEM(t->kids, (Py_ssize_t)i);
            PyObject *next;
            if (kids == Py_None) {
                next = PyList_GET_ITEM(t->one, (Py_ssize_t)i);
            } else {
                PyObject *key = PyList_GET_ITEM(t->best, (Py_ssize_t)i);
                next = PyDict_GetItemWithError(kids, key);
                if (next == NULL) {
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "suffix core draft: a best child missing");
                    return -1;
                }
            }
            obj = PyLong_AsLongLong(next);
            if (obj == -1 && PyErr_Occurred()) return -1;
        } else { /* a single occurrence: the rest of the path is the sequence itself */
            long long pos = obj & POS;
            PyObject *sid = PyLong_FromLongLong(obj >> SHIFT);
            if (sid == NULL) return -1;
            PyObject *seq = PyDict_GetItemWithError(t->seqs, sid);
            Py_DECREF(sid);
            if (seq == NULL || !PyList_Check(seq)) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "suffix core draft: a leaf's sequence missing");
                return -1;
            }
            long long m = budget - PyList_GET_SIZE(toks), rest = PyList_GET_SIZE(seq) - pos - 1;
            if (rest < m) m = rest;
            if (t->D - depth < m) m = t->D - depth;
            for (long long j = 0; j < m; j++) {
                if (PyList_Append(toks, PyList_GET_ITEM(seq, (Py_ssize_t)(pos + 1 + j))) < 0 ||
                    append_double(probs, prob) < 0)
                    return -1;
            }
            break;
        }
    }
    return 0;
}

typedef struct {
    long long budget, k, count, state;
    int trie;        /* 0: the sequence's own, 1: the global one */
    Py_ssize_t order; /* the candidate's index: own trie's first */
} Group;

static int by_length(const void *a, const void *b) { /* longest match first, then candidate order */
    const Group *x = a, *y = b;
    if (x->k != y->k) return x->k > y->k ? -1 : 1;
    return (x->order > y->order) - (x->order < y->order);
}

static PyObject *draft(PyObject *self, PyObject *args) {
    PyObject *active, *own_fields, *gstates, *glob_fields;
    long long n_max, min_match;
    double p_min, factor, offset;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OO!OLLddd", &PyList_Type, &active, &own_fields, &PyList_Type, &gstates,
                          &glob_fields, &n_max, &min_match, &p_min, &factor, &offset))
        return NULL;
    Trie tries[2];
    if (read_trie(own_fields, &tries[0]) < 0 || read_trie(glob_fields, &tries[1]) < 0) return NULL;
    Py_ssize_t n_own = PyList_GET_SIZE(active), n_all = n_own + PyList_GET_SIZE(gstates);
    Group *groups = PyMem_Malloc((size_t)(n_all > 0 ? n_all : 1) * sizeof(Group));
    if (groups == NULL) return PyErr_NoMemory();
    PyObject *result = NULL, *best_toks = NULL, *best_probs = NULL, *toks = NULL, *probs = NULL;
    Py_ssize_t n_groups = 0;
    for (Py_ssize_t c = 0; c < n_all; c++) { /* suffix_draft's grouping: one walk per (trie, count), the longest */
        int ti = c >= n_own;
        long long k = (ti ? c - n_own : c) + 1, state;
        if (k < min_match) continue;
        if (!ti) {
            if (get_ll(active, c, &state) < 0) goto done;
            state = ~state;
        } else if (get_ll(gstates, c - n_own, &state) < 0) {
            goto done;
        }
        long long budget = (long long)((double)k * factor + offset + 1e-6);
        if (n_max < budget) budget = n_max;
        if (tries[ti].D - k < budget) budget = tries[ti].D - k;
        if (budget <= 0) continue;
        long long count;
        if (count_of(&tries[ti], state, &count) < 0) goto done;
        Py_ssize_t g = 0;
        while (g < n_groups && (groups[g].trie != ti || groups[g].count != count)) g++;
        if (g == n_groups) {
            n_groups++;
        } else if (!(budget > groups[g].budget || (budget == groups[g].budget && k > groups[g].k))) {
            continue;
        }
        groups[g] = (Group){budget, k, count, state, ti, c};
    }
    qsort(groups, (size_t)n_groups, sizeof(Group), by_length);
    double best_score = 0.0;
    Group chosen = {0};
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        Group *x = &groups[g];
        Trie *t = &tries[x->trie];
        if (x->state < 0) { /* skip what cannot beat the best: a path's score is at most budget x its first step */
            long long bc, n;
            if (fresh_bestc(t, ~x->state, &bc) < 0 || count_of(t, x->state, &n) < 0) goto done;
            if (bc <= 0 || n <= 0 || (double)(x->budget * bc) / (double)n <= best_score) continue;
        } else if ((double)x->budget <= best_score) {
            continue;
        }
        toks = PyList_New(0);
        probs = PyList_New(0);
        if (toks == NULL || probs == NULL || walk(t, x->k, x->state, x->budget, p_min, toks, probs) < 0) goto done;
        Py_ssize_t n = PyList_GET_SIZE(probs);
        double score = 0.0;
        for (Py_ssize_t j = 0; j < n; j++) score += PyFloat_AS_DOUBLE(PyList_GET_ITEM(probs, j));
        if (n > 0 && score > best_score) {
            best_score = score;
            chosen = *x;
            Py_XSETREF(best_toks, toks);
            Py_XSETREF(best_probs, probs);
        } else {
            Py_DECREF(toks);
            Py_DECREF(probs);
        }
        toks = probs = NULL;
    }
    if (best_toks == NULL) {
        result = Py_NewRef(Py_None);
    } else {
        result = Py_BuildValue("(OOdLiLL)", best_toks, best_probs, best_score, chosen.k, chosen.trie, chosen.state,
                               chosen.budget);
    }
done:
    PyMem_Free(groups);
    Py_XDECREF(toks);
    Py_XDECREF(probs);
    Py_XDECREF(best_toks);
    Py_XDECREF(best_probs);
    return result;
}

static PyMethodDef methods[] = {
    {"advance", advance, METH_VARARGS,
     "advance(states, tokens, max_depth, seqs, best, one, kids_of) -> states: SuffixTrie.advance_through_reference's "
     "loop, compiled"},
    {"extend", extend, METH_VARARGS,
     "extend(seq, act, tokens, base, max_depth, seqs, actives, cnt, best, bestc, one, kids_of, free, rescan) -> "
     "act: SuffixTrie.extend_reference's loop, compiled"},
    {"draft", draft, METH_VARARGS,
     "draft(active, own_fields, gstates, global_fields, n_max, min_match, p_min, factor, offset) -> None or (tokens, "
     "probs, score, match_len, from_global, state, budget): suffix_draft over a sequence's candidates, compiled"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_suffix_core",
                                    "The compiled core of suffix.py's SuffixTrie.extend and .advance_through.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__suffix_core(void) {
    PyObject *m = PyModule_Create(&module);
    /* suffix.py checks it against its own _SHIFT at import */
    if (m != NULL && PyModule_AddIntConstant(m, "LEAF_SHIFT", SHIFT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
