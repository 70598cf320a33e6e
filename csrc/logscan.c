/* The fast paths of `overflow-fast diff` in C, each the twin of a Python function that is its specification:
 *
 * - scan: the entry records of a chunk of a JSONL log (entries.py's EntryReader). Each line is
 *   matched against the writer's own form of an entry record, as entries.py's regular expression
 *   matches it, and kept as the same Entry: (the kept fields' texts, its line number). What a line
 *   must be comes from Python (entries.scan_program(), generated from the schema): a list of items,
 *   each a literal (`,"name":`) and the form of its value. Every value form is matched greedily: a
 *   value never holds the character that follows it (`,` or `}`), so the one way it can end before
 *   them is the way the regular expression ends it. A line that does not match, or whose texts are
 *   not UTF-8, goes to the caller's slow path, in order.
 * - run_length: how far two logs' records pair one with the other (diff.py's _run_length).
 * - divergence: the relative difference of a pair (diff.py's divergence).
 *
 * Plain CPython, no torch: reading a log never imports it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KIND_NONE = 0, KIND_INT = 1, KIND_STR = 2, KIND_CHOICE = 3, KIND_ABS = 4, KIND_FRAC = 5 };
#define MAX_ITEMS 64
#define MAX_CHOICES 8
#define MAX_KEPT 64

typedef struct {
    const char *text;
    Py_ssize_t len;
} Span;

typedef struct {
    Span literal;
    int kind;
    int kept;  /* index in the Entry's fields, or -1 */
    int nullable;
    int optional;
    int digits;  /* an int's most digits */
    int nchoices;
    Span choices[MAX_CHOICES];
} Item;

typedef struct {
    Item items[MAX_ITEMS];
    int n;
    int nkept;
} Program;

static int span_of(PyObject *obj, Span *span, const char *what) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "scan program: %s must be bytes", what);
        return -1;
    }
    span->text = PyBytes_AS_STRING(obj);
    span->len = PyBytes_GET_SIZE(obj);
    return 0;
}

/* items: a tuple of (literal, kind, kept, nullable, optional, digits, choices) */
static int read_program(PyObject *items, int nkept, Program *program) {
    if (!PyTuple_Check(items) || PyTuple_GET_SIZE(items) > MAX_ITEMS || nkept < 0 || nkept > MAX_KEPT) {
        PyErr_SetString(PyExc_ValueError, "scan program: a tuple of at most 64 items, at most 64 kept");
        return -1;
    }
    program->n = (int)PyTuple_GET_SIZE(items);
    program->nkept = nkept;
    for (int i = 0; i < program->n; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i), *choices;
        Item *it = &program->items[i];
        PyObject *literal;
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "OiippiO", &literal, &it->kind, &it->kept, &it->nullable,
                                                      &it->optional, &it->digits, &choices)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "scan program: an item is a tuple");
            return -1;
        }
        if (span_of(literal, &it->literal, "a literal") < 0)
            return -1;
        if (it->kind < KIND_NONE || it->kind > KIND_FRAC || it->kept < -1 || it->kept >= nkept || it->digits < 0
                || (it->kind == KIND_NONE && (it->kept != -1 || it->nullable))) {
            PyErr_SetString(PyExc_ValueError, "scan program: an item out of range");
            return -1;
        }
        if (!PyTuple_Check(choices) || PyTuple_GET_SIZE(choices) > MAX_CHOICES) {
            PyErr_SetString(PyExc_ValueError, "scan program: choices are a tuple of at most 8");
            return -1;
        }
        it->nchoices = (int)PyTuple_GET_SIZE(choices);
        for (int c = 0; c < it->nchoices; c++) {
            Span *choice = &it->choices[c];
            if (span_of(PyTuple_GET_ITEM(choices, c), choice, "a choice") < 0)
                return -1;
            if (memchr(choice->text, '"', (size_t)choice->len) != NULL) {
                PyErr_SetString(PyExc_ValueError, "scan program: a choice holds a quote");
                return -1;
            }
        }
    }
    return 0;
}

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Up to `most` digits from p: how many. */
static inline Py_ssize_t count_digits(const char *p, const char *end, Py_ssize_t most) {
    Py_ssize_t n = 0;
    while (n < most && p + n < end && is_digit(p[n]))
        n++;
    return n;
}

/* Whether the len bytes at p and at text are the same: short texts (literals, names), compared a
 * word at a time without a call. */
static inline int same_bytes(const char *p, const char *text, Py_ssize_t len) {
    uint64_t x, y;
    while (len >= 8) {
        memcpy(&x, p, 8);
        memcpy(&y, text, 8);
        if (x != y)
            return 0;
        p += 8;
        text += 8;
        len -= 8;
    }
    while (len > 0) {
        if (*p++ != *text++)
            return 0;
        len--;
    }
    return 1;
}

static inline int starts_with(const char *p, const char *end, const char *text, Py_ssize_t len) {
    return end - p >= len && same_bytes(p, text, len);
}

/* 0|[1-9][0-9]{0,digits-1} */
static const char *match_int(const char *p, const char *end, int digits) {
    if (p >= end)
        return NULL;
    if (*p == '0')
        return p + 1;
    if (*p < '1' || *p > '9')
        return NULL;
    return p + 1 + count_digits(p + 1, end, digits - 1);
}

/* A finite number >= 0: (0|[1-9][0-9]{0,19})(\.[0-9]+)?([eE](-[0-9]{1,3}|\+?[0-9]{1,2}))? */
static const char *match_float(const char *p, const char *end) {
    const char *q = match_int(p, end, 20);
    if (q == NULL)
        return NULL;
    if (q < end && *q == '.') {
        Py_ssize_t n = count_digits(q + 1, end, PY_SSIZE_T_MAX);
        if (n > 0)
            q += 1 + n;
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        const char *r = q + 1;
        Py_ssize_t n;
        if (r < end && *r == '-') {
            n = count_digits(r + 1, end, 3);
            if (n > 0)
                q = r + 1 + n;
        } else {
            if (r < end && *r == '+')
                r++;
            n = count_digits(r, end, 2);
            if (n > 0)
                q = r + n;
        }
    }
    return q;
}

/* A number in [0, 1], three forms; the one that a delimiter follows (at most one can be). */
static const char *match_fraction(const char *p, const char *end) {
    const char *found[3] = {NULL, NULL, NULL};
    if (p >= end)
        return NULL;
    if (*p == '0') {  /* 0(\.[0-9]+)?([eE]-[0-9]{1,3})? */
        const char *q = p + 1;
        Py_ssize_t n;
        if (q < end && *q == '.' && (n = count_digits(q + 1, end, PY_SSIZE_T_MAX)) > 0)
            q += 1 + n;
        if (q + 1 < end && (*q == 'e' || *q == 'E') && q[1] == '-' && (n = count_digits(q + 2, end, 3)) > 0)
            q += 2 + n;
        found[0] = q;
    }
    if (*p == '1') {  /* 1(\.0+)? */
        const char *q = p + 1;
        if (q + 1 < end && *q == '.' && q[1] == '0') {
            q += 2;
            while (q < end && *q == '0')
                q++;
        }
        found[1] = q;
    }
    if (*p >= '1' && *p <= '9') {  /* [1-9](\.[0-9]+)?[eE]-0*[1-9][0-9]{0,2} */
        const char *q = p + 1;
        Py_ssize_t n;
        if (q < end && *q == '.' && (n = count_digits(q + 1, end, PY_SSIZE_T_MAX)) > 0)
            q += 1 + n;
        if (q + 1 < end && (*q == 'e' || *q == 'E') && q[1] == '-') {
            q += 2;
            while (q < end && *q == '0')
                q++;
            if (q < end && *q >= '1' && *q <= '9')
                found[2] = q + 1 + count_digits(q + 1, end, 2);
        }
    }
    for (int i = 0; i < 3; i++)
        if (found[i] != NULL && found[i] < end && (*found[i] == ',' || *found[i] == '}'))
            return found[i];
    return NULL;
}

/* The bytes that end a name's text: a quote, a backslash, a control character. */
static unsigned char ends_text[256];

static void fill_ends_text(void) {
    for (int c = 0; c < 0x20; c++)
        ends_text[c] = 1;
    ends_text['"'] = ends_text['\\'] = 1;
}

/* "..." without a quote, a backslash or a control character: the end of its text (at its closing
 * quote), or NULL; *high: whether it holds a byte over 0x7f (then it must be UTF-8). */
static const char *match_text(const char *p, const char *end, int *high) {
    const char *q;
    unsigned char bits = 0;
    if (p >= end || *p != '"')
        return NULL;
    for (q = p + 1; q < end; q++) {
        unsigned char c = (unsigned char)*q;
        if (ends_text[c])
            break;
        bits |= c;
    }
    if (q >= end || *q != '"')
        return NULL;
    *high = (bits & 0x80) != 0;
    return q;
}

static int is_choice(const Item *it, const char *text, Py_ssize_t len) {
    for (int c = 0; c < it->nchoices; c++)
        if (it->choices[c].len == len && memcmp(it->choices[c].text, text, (size_t)len) == 0)
            return 1;
    return 0;
}

/* The value of `it` at p: where it ends (NULL: no match); the kept group's span in *group (text
 * NULL: unset, as a null is); *high as match_text's. */
static const char *match_value(const Item *it, const char *p, const char *end, Span *group, int *high) {
    group->text = NULL;
    group->len = 0;
    if (it->nullable && it->kind != KIND_ABS && starts_with(p, end, "null", 4))
        return p + 4;
    const char *q;
    switch (it->kind) {
    case KIND_NONE:
        return p;
    case KIND_INT:
        q = match_int(p, end, it->digits);
        break;
    case KIND_FRAC:
        q = match_fraction(p, end);
        break;
    case KIND_STR:
    case KIND_CHOICE: {
        const char *close = match_text(p, end, high);
        if (close == NULL)
            return NULL;
        if (it->kind == KIND_CHOICE && !is_choice(it, p + 1, close - p - 1))
            return NULL;
        group->text = p + 1;
        group->len = close - p - 1;
        return close + 1;
    }
    case KIND_ABS:
        if (p < end && *p == '"') {
            const char *close = memchr(p + 1, '"', (size_t)(end - p - 1));
            if (close == NULL || !is_choice(it, p + 1, close - p - 1))
                return NULL;
            q = close + 1;
        } else if (starts_with(p, end, "null", 4)) {
            q = p + 4;
        } else {
            q = match_float(p, end);
        }
        break;
    default:
        return NULL;
    }
    if (q != NULL) {
        group->text = p;
        group->len = q - p;
    }
    return q;
}

/* Whether a text with bytes over 0x7f is UTF-8 (Python's own decoder decides). */
static int is_utf8(const Span *span) {
    PyObject *text = PyUnicode_DecodeUTF8(span->text, span->len, NULL);
    if (text == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(text);
    return 1;
}

/* The line [p, end) as an entry record: its kept groups in spans[], 1; or 0 (not one, or a text
 * that is not kept is not UTF-8: the kept ones are checked as they are made). */
static int match_line(const Program *program, const char *p, const char *end, Span *spans) {
    for (int k = 0; k < program->nkept; k++)
        spans[k].text = NULL;
    for (int i = 0; i < program->n; i++) {
        const Item *it = &program->items[i];
        Span group;
        int high = 0;
        if (!starts_with(p, end, it->literal.text, it->literal.len)) {
            if (it->optional)
                continue;
            return 0;
        }
        p = match_value(it, p + it->literal.len, end, &group, &high);
        if (p == NULL)
            return 0;
        if (it->kept >= 0)
            spans[it->kept] = group;
        else if (high && !is_utf8(&group))
            return 0;
    }
    return p + 1 == end && *p == '}';
}

/* The texts made lately, per kept field: most repeat from line to line (the step, the phase, the
 * module, its class, the entry, the dtype, the counts), and one object for each saves making it and
 * the memory it would take. */
#define RECENT 4
typedef struct {
    PyObject *texts[MAX_KEPT][RECENT];
    int next[MAX_KEPT];
} Recent;

static void recent_clear(Recent *recent, int nkept) {
    for (int k = 0; k < nkept; k++)
        for (int r = 0; r < RECENT; r++)
            Py_CLEAR(recent->texts[k][r]);
}

/* The str of a kept group, new or recent; NULL with no error set where it is not UTF-8. */
static PyObject *text_of(Recent *recent, int k, const Span *span) {
    for (int r = 0; r < RECENT; r++) {
        PyObject *text = recent->texts[k][r];
        if (text != NULL && PyUnicode_GET_LENGTH(text) == span->len
                && same_bytes(PyUnicode_DATA(text), span->text, span->len)) {
            Py_INCREF(text);
            return text;
        }
    }
    PyObject *text = PyUnicode_DecodeUTF8(span->text, span->len, NULL);
    if (text == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();
        return NULL;
    }
    if (PyUnicode_IS_ASCII(text)) {  /* its data are the line's bytes: compared as above */
        int r = recent->next[k];
        Py_XDECREF(recent->texts[k][r]);
        Py_INCREF(text);
        recent->texts[k][r] = text;
        recent->next[k] = (r + 1) % RECENT;
    }
    return text;
}

/* The Entry of a matched line; NULL with no error set where a name is not UTF-8 (the slow path
 * says why), NULL with an error set where memory ran out. */
static PyObject *entry_of(const Program *program, const Span *spans, Recent *recent, PyObject *empty,
                          Py_ssize_t number) {
    PyObject *fields = PyTuple_New(program->nkept);
    if (fields == NULL)
        return NULL;
    for (int k = 0; k < program->nkept; k++) {
        PyObject *text;
        if (spans[k].text == NULL) {
            Py_INCREF(empty);
            text = empty;
        } else {
            text = text_of(recent, k, &spans[k]);
            if (text == NULL) {
                Py_DECREF(fields);
                return NULL;
            }
        }
        PyTuple_SET_ITEM(fields, k, text);
    }
    PyObject *line = PyLong_FromSsize_t(number);
    if (line == NULL) {
        Py_DECREF(fields);
        return NULL;
    }
    PyObject *entry = PyTuple_New(2);
    if (entry == NULL) {
        Py_DECREF(fields);
        Py_DECREF(line);
        return NULL;
    }
    PyTuple_SET_ITEM(entry, 0, fields);
    PyTuple_SET_ITEM(entry, 1, line);
    /* strings and an int: no cycle can pass through them (the collector would untrack them too) */
    PyObject_GC_UnTrack(fields);
    PyObject_GC_UnTrack(entry);
    return entry;
}

static const char scan_doc[] =
    "scan(chunk, number, out, slow, items, kept) -> number\n\n"
    "Append to the list `out` the Entry (fields, line number) of each line of `chunk` (bytes of whole\n"
    "lines, the last one may lack its newline) that matches the program `items` (kept: its number of\n"
    "fields); for any other line, call slow(line bytes, its line number, out). Lines are numbered from\n"
    "number + 1; returns the last one's number.";

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer chunk;
    Py_ssize_t number;
    PyObject *out, *slow, *items;
    int nkept;
    Program program;
    Span spans[MAX_KEPT];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nO!OO!i", &chunk, &number, &PyList_Type, &out, &slow, &PyTuple_Type, &items,
                          &nkept))
        return NULL;
    Recent recent;
    memset(&recent, 0, sizeof recent);
    PyObject *empty = NULL;
    if (read_program(items, nkept, &program) < 0 || (empty = PyUnicode_FromStringAndSize("", 0)) == NULL) {
        PyBuffer_Release(&chunk);
        return NULL;
    }
    const char *p = chunk.buf, *end = p + chunk.len;
    int failed = 0;
    while (p < end) {
        const char *newline = memchr(p, '\n', (size_t)(end - p));
        const char *eol = newline != NULL ? newline : end;
        number++;
        PyObject *entry = NULL;
        if (match_line(&program, p, eol, spans)) {
            entry = entry_of(&program, spans, &recent, empty, number);
            if (entry == NULL && PyErr_Occurred()) {
                failed = 1;
                break;
            }
        }
        if (entry != NULL) {
            int appended = PyList_Append(out, entry);
            Py_DECREF(entry);
            if (appended < 0) {
                failed = 1;
                break;
            }
        } else {
            PyObject *result = PyObject_CallFunction(slow, "y#nO", p, (Py_ssize_t)(eol - p), number, out);
            if (result == NULL) {
                failed = 1;
                break;
            }
            Py_DECREF(result);
        }
        p = newline != NULL ? newline + 1 : end;
    }
    recent_clear(&recent, program.nkept);
    Py_DECREF(empty);
    PyBuffer_Release(&chunk);
    if (failed)
        return NULL;
    return PyLong_FromSsize_t(number);
}

static const char run_length_doc[] =
    "run_length(entries_a, a, entries_b, b, keys, same) -> n\n\n"
    "How many pairs (entries_a[a + i], entries_b[b + i]) from i = 0 on have equal fields at every index\n"
    "of `keys`, and the fields at every index of `same` equal to the first pair's: the records that two\n"
    "logs in step pair one with the other, in one step.";

/* 1, 0, or -1 with an error set: the texts of an Entry are str (no Python code runs to compare
 * them, so the lists cannot change under this loop) */
static int field_equal(PyObject *x, PyObject *y) {
    if (x == y)
        return 1;
    if (!PyUnicode_CheckExact(x) || !PyUnicode_CheckExact(y)) {
        PyErr_SetString(PyExc_TypeError, "run_length: an entry's fields are str");
        return -1;
    }
    return PyUnicode_Compare(x, y) == 0;
}

static PyObject *fields_of(PyObject *entries, Py_ssize_t i) {
    PyObject *entry = PyList_GET_ITEM(entries, i);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 1 || !PyTuple_Check(PyTuple_GET_ITEM(entry, 0))) {
        PyErr_SetString(PyExc_TypeError, "run_length: an entry is (fields tuple, line)");
        return NULL;
    }
    return PyTuple_GET_ITEM(entry, 0);
}

static PyObject *run_length(PyObject *self, PyObject *args) {
    PyObject *entries_a, *entries_b, *keys, *same;
    Py_ssize_t a, b, index[2 * MAX_KEPT];
    int nkeys, nsame;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!nO!nO!O!", &PyList_Type, &entries_a, &a, &PyList_Type, &entries_b, &b,
                          &PyTuple_Type, &keys, &PyTuple_Type, &same))
        return NULL;
    nkeys = (int)PyTuple_GET_SIZE(keys);
    nsame = (int)PyTuple_GET_SIZE(same);
    if (nkeys > MAX_KEPT || nsame > MAX_KEPT) {
        PyErr_SetString(PyExc_ValueError, "run_length: too many fields");
        return NULL;
    }
    for (int k = 0; k < nkeys + nsame; k++) {
        PyObject *item = k < nkeys ? PyTuple_GET_ITEM(keys, k) : PyTuple_GET_ITEM(same, k - nkeys);
        index[k] = PyLong_AsSsize_t(item);
        if (index[k] == -1 && PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t n = 0, len_a = PyList_GET_SIZE(entries_a), len_b = PyList_GET_SIZE(entries_b);
    if (a < 0 || b < 0)
        return PyLong_FromSsize_t(0);
    PyObject *first = NULL;
    while (a + n < len_a && b + n < len_b) {
        PyObject *fa = fields_of(entries_a, a + n), *fb = fa == NULL ? NULL : fields_of(entries_b, b + n);
        if (fb == NULL)
            return NULL;
        if (first == NULL)
            first = fa;
        Py_ssize_t size = PyTuple_GET_SIZE(fa) < PyTuple_GET_SIZE(fb) ? PyTuple_GET_SIZE(fa) : PyTuple_GET_SIZE(fb);
        int pairs = 1;
        for (int k = 0; k < nkeys + nsame && pairs == 1; k++) {
            Py_ssize_t i = index[k];
            if (i < 0 || i >= size || i >= PyTuple_GET_SIZE(first)) {
                PyErr_SetString(PyExc_IndexError, "run_length: a field index out of range");
                return NULL;
            }
            pairs = k < nkeys ? field_equal(PyTuple_GET_ITEM(fa, i), PyTuple_GET_ITEM(fb, i))
                              : field_equal(PyTuple_GET_ITEM(fa, i), PyTuple_GET_ITEM(first, i));
        }
        if (pairs < 0)
            return NULL;
        if (!pairs)
            break;
        n++;
    }
    return PyLong_FromSsize_t(n);
}

static const char divergence_doc[] =
    "divergence(fields_a, fields_b, atol, compared, counts, quoted, bad) -> (value, which)\n\n"
    "diff.divergence of two entries' fields: (inf, bad) where one recorded a nan/inf (a text at an\n"
    "index of `counts` other than \"0\", or the text at `quoted` in quotes) and the other did not; else\n"
    "the largest relative difference over the indices `compared` and the index it comes from (None: 0).";

/* float(text): NULL with ValueError cleared and *failed set where it is not a number */
static int to_double(PyObject *text, double *value, int *failed) {
    PyObject *number = PyFloat_FromString(text);
    *failed = 0;
    if (number == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return -1;
        PyErr_Clear();
        *failed = 1;
        return 0;
    }
    *value = PyFloat_AS_DOUBLE(number);
    Py_DECREF(number);
    return 0;
}

/* entries.magnitude: None ("null") or float(text without its quotes); -1 on an error */
static int magnitude(PyObject *text, double *value, int *none) {
    *none = PyUnicode_CompareWithASCIIString(text, "null") == 0;
    if (*none)
        return 0;
    Py_ssize_t start = 0, end = PyUnicode_GET_LENGTH(text);
    while (start < end && PyUnicode_READ_CHAR(text, start) == '"')
        start++;
    while (end > start && PyUnicode_READ_CHAR(text, end - 1) == '"')
        end--;
    PyObject *inner = PyUnicode_Substring(text, start, end);
    if (inner == NULL)
        return -1;
    PyObject *number = PyFloat_FromString(inner);
    Py_DECREF(inner);
    if (number == NULL)
        return -1;
    *value = PyFloat_AS_DOUBLE(number);
    Py_DECREF(number);
    return 0;
}

static int text_at(PyObject *fields, PyObject *index_obj, PyObject **text) {
    Py_ssize_t index = PyLong_AsSsize_t(index_obj);
    if (index == -1 && PyErr_Occurred())
        return -1;
    if (index < 0 || index >= PyTuple_GET_SIZE(fields)) {
        PyErr_SetString(PyExc_IndexError, "divergence: a field index out of range");
        return -1;
    }
    *text = PyTuple_GET_ITEM(fields, index);
    if (!PyUnicode_Check(*text)) {
        PyErr_SetString(PyExc_TypeError, "divergence: an entry's fields are str");
        return -1;
    }
    return 0;
}

/* entries.is_bad: 1, 0, or -1 on an error */
static int is_bad(PyObject *fields, PyObject *counts, PyObject *quoted) {
    PyObject *text;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(counts); i++) {
        if (text_at(fields, PyTuple_GET_ITEM(counts, i), &text) < 0)
            return -1;
        if (PyUnicode_CompareWithASCIIString(text, "0") != 0)
            return 1;
    }
    if (text_at(fields, quoted, &text) < 0)
        return -1;
    if (PyUnicode_GET_LENGTH(text) == 0) {
        PyErr_SetString(PyExc_IndexError, "divergence: an empty abs text");
        return -1;
    }
    return PyUnicode_READ_CHAR(text, 0) == '"';
}

static PyObject *divergence(PyObject *self, PyObject *args) {
    PyObject *fa, *fb, *compared, *counts, *quoted, *bad;
    double atol;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!dO!O!OO", &PyTuple_Type, &fa, &PyTuple_Type, &fb, &atol, &PyTuple_Type,
                          &compared, &PyTuple_Type, &counts, &quoted, &bad))
        return NULL;
    int bad_a = is_bad(fa, counts, quoted), bad_b = bad_a < 0 ? -1 : is_bad(fb, counts, quoted);
    if (bad_b < 0)
        return NULL;
    if (bad_a != bad_b)
        return Py_BuildValue("(dO)", INFINITY, bad);
    double largest = 0.0;
    PyObject *which = Py_None;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(compared); i++) {
        PyObject *field = PyTuple_GET_ITEM(compared, i), *text_a, *text_b;
        if (text_at(fa, field, &text_a) < 0 || text_at(fb, field, &text_b) < 0)
            return NULL;
        int equal = PyUnicode_Compare(text_a, text_b);
        if (equal == -1 && PyErr_Occurred())
            return NULL;
        if (equal == 0)
            continue;
        double x = 0.0, y = 0.0, value;
        int failed_x, failed_y = 0;
        if (to_double(text_a, &x, &failed_x) < 0 || (!failed_x && to_double(text_b, &y, &failed_y) < 0))
            return NULL;
        if (failed_x || failed_y) {  /* diff._special */
            int none_x, none_y;
            if (magnitude(text_a, &x, &none_x) < 0 || magnitude(text_b, &y, &none_y) < 0)
                return NULL;
            value = none_x || none_y || (isfinite(x) != 0) == (isfinite(y) != 0) ? 0.0 : INFINITY;
        } else {
            double difference = fabs(x - y), larger = x > y ? x : y;
            if (difference <= atol) {
                value = 0.0;
            } else if (larger == 0.0) {
                PyErr_SetString(PyExc_ZeroDivisionError, "float division by zero");
                return NULL;
            } else {
                value = difference / larger;
            }
        }
        if (value > largest) {
            largest = value;
            which = field;
        }
    }
    return Py_BuildValue("(dO)", largest, which);
}

static PyMethodDef methods[] = {
    {"divergence", divergence, METH_VARARGS, divergence_doc},
    {"scan", scan, METH_VARARGS, scan_doc},
    {"run_length", run_length, METH_VARARGS, run_length_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "overflow_fast._logscan", "The fast paths of overflow-fast diff (report/logscan.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__logscan(void) {
    fill_ends_text();
    return PyModule_Create(&module);
}
