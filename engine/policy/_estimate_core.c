/* The compiled core of estimates.py's ValueEstimates.estimate: AcceptanceTracker.prefix_probs and then
 * PrefixCalibration.apply, the same floating-point operations in the same order, so both arrays are bitwise what
 * the two Python loops give. ValueEstimates.estimate_reference runs those loops; the tests hold the two equal
 * (tests/unit/test_estimate_core.py).
 *
 * Why C: every draft a round's speculators make is estimated before the planner sees it, a few to a few dozen
 * positions each. Interpreted, reading the tracker's rows into lists, the two loops and the conversions between
 * lists and arrays cost more than the rest of scoring the draft.
 *
 * estimate(out, pos_acc, pos_trials, cell_acc, cell_trials, g, w, ws, k, factors)
 *   out: a writable float64 buffer of 2 x length; its first row gets the raw prefix probabilities, its second the
 *   calibrated ones. pos_acc, pos_trials: the tracker's pooled counts by position (float64 buffers of one length);
 *   cell_acc, cell_trials: its (state, context) cell's counts by position bucket (float64, N_BUCKETS each);
 *   g: the global rate; w, ws: the position and state pseudo-trials; k: the sequence's odds factor
 *   (exp(logit(rate) - logit(g))); factors: the calibration's factor per bucket (a sequence of N_BUCKETS floats).
 *   Position j's bucket is 0 for j = 0, else floor(log2 j) + 1, at most N_BUCKETS - 1 (acceptance.pos_buckets).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define N_BUCKETS 8 /* acceptance.N_POS_BUCKETS */
#define EPS 1e-3    /* acceptance.RATE_EPS */
#define P_MAX 0.999 /* calibration.P_MAX */

static int bucket(Py_ssize_t j) {
    int b = 0;
    while (j > 0 && b < N_BUCKETS - 1) { /* the bit length of j, capped */
        j >>= 1;
        b++;
    }
    return b;
}

static int f64_buffer(Py_buffer *v, Py_ssize_t at_least, const char *what) {
    if (v->itemsize != (Py_ssize_t)sizeof(double) || v->len < at_least * (Py_ssize_t)sizeof(double)) {
        PyErr_Format(PyExc_ValueError, "estimate core: %s must be a float64 buffer of at least %zd values", what,
                     at_least);
        return -1;
    }
    return 0;
}

static PyObject *estimate(PyObject *self, PyObject *args) {
    Py_buffer out, pos_acc, pos_trials, cell_acc, cell_trials;
    double g, w, ws, k;
    PyObject *factors;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*ddddO", &out, &pos_acc, &pos_trials, &cell_acc, &cell_trials, &g, &w, &ws,
                          &k, &factors))
        return NULL;
    PyObject *result = NULL;
    PyObject *fs = NULL;
    Py_ssize_t length = out.len / (Py_ssize_t)(2 * sizeof(double));
    Py_ssize_t m = pos_trials.len / (Py_ssize_t)sizeof(double);
    if (f64_buffer(&out, 2 * length, "out") < 0 || f64_buffer(&pos_trials, m, "pos_trials") < 0 ||
        f64_buffer(&pos_acc, m, "pos_acc") < 0 || f64_buffer(&cell_acc, N_BUCKETS, "cell_acc") < 0 ||
        f64_buffer(&cell_trials, N_BUCKETS, "cell_trials") < 0)
        goto done;
    fs = PySequence_Fast(factors, "estimate core: factors must be a sequence");
    if (fs == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(fs) != N_BUCKETS) {
        PyErr_SetString(PyExc_ValueError, "estimate core: one factor per position bucket");
        goto done;
    }
    double f[N_BUCKETS];
    for (int b = 0; b < N_BUCKETS; b++) {
        f[b] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fs, b));
        if (f[b] == -1.0 && PyErr_Occurred()) goto done;
    }
    if (m > length) m = length;
    const double *pa = (const double *)pos_acc.buf, *pt = (const double *)pos_trials.buf;
    const double *ca = (const double *)cell_acc.buf, *ct = (const double *)cell_trials.buf;
    double *raw = (double *)out.buf, *cal = raw + length;
    const double wg = w * g;
    double run = 1.0, low = Py_HUGE_VAL;
    for (Py_ssize_t j = 0; j < length; j++) { /* prefix_probs' steps, then apply's, in their order */
        double prof = j < m ? (pa[j] + wg) / (pt[j] + w) : g;
        int b = bucket(j);
        double c = (ca[b] + ws * prof) / (ct[b] + ws);
        if (EPS > c) c = EPS; /* max(c, EPS) */
        if (1 - EPS < c) c = 1 - EPS; /* min(c, 1 - EPS) */
        double ck = c * k;
        run *= ck / (ck + (1.0 - c));
        raw[j] = run;
        double scaled = run * f[b];
        if (P_MAX < scaled) scaled = P_MAX;
        if (scaled < low) low = scaled;
        cal[j] = low;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(fs);
    PyBuffer_Release(&out);
    PyBuffer_Release(&pos_acc);
    PyBuffer_Release(&pos_trials);
    PyBuffer_Release(&cell_acc);
    PyBuffer_Release(&cell_trials);
    return result;
}

static PyMethodDef methods[] = {
    {"estimate", estimate, METH_VARARGS,
     "estimate(out, pos_acc, pos_trials, cell_acc, cell_trials, g, w, ws, k, factors): ValueEstimates."
     "estimate_reference's two loops, compiled"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_estimate_core",
                                    "The compiled core of estimates.py's ValueEstimates.estimate.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__estimate_core(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* estimates.py checks these against acceptance.py's and calibration.py's at import */
    PyObject *consts = Py_BuildValue("(idd)", N_BUCKETS, EPS, P_MAX);
    if (consts == NULL || PyModule_AddObject(m, "CONSTANTS", consts) < 0) {
        Py_XDECREF(consts);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
