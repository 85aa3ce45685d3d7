/* Gopher's word counts of a text, compiled: what pipeline/clean/filters.py's _Pieces.counts
 * computes, with the same words. The words themselves still come from the Python objects it is
 * given (the _WORD_FAST regexes and _piece_words); this file only does the steps around them
 * that cost most in Python: splitting the text at white space, looking each piece up in a cache,
 * spaCy's checks on a new piece, and counting each word's characters.
 *
 * Counter(findall_ascii, findall, piece_words, url_fullmatch, special_pieces, split_words,
 *         split_alnum, stop_bits, punctuation, cache_size)
 * Counter.counts(text) -> (words, real words, characters in real words, words with a letter,
 *                          distinct stop words)
 * Counter.forget()
 *
 * Definitions (filters.py holds the reference, tests/test_clean.py holds both to them):
 *   a piece: a run of characters that are not Py_UNICODE_ISSPACE (str.split());
 *   a piece of letters and digits only (Py_UNICODE_ISALNUM each: str.isalnum) is one word,
 *     unless it is in split_alnum ("cannot"); the other pieces' words are findall's, or
 *     piece_words' where spaCy's tables may change them (_spacy_pieces's four checks);
 *   a word is real if its first character is alphanumeric or any character is not in
 *     punctuation; it has a letter if any character is Py_UNICODE_ISALPHA;
 *   the stop words are stop_bits' keys, each a bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t words, real, real_chars, alpha, stop;
} Row;

#define ROWS_START 4096 /* rows allocated at first */

/* A small set of short ASCII strings (split_alnum, the stop words), each with a value. */
#define SMALL_SLOTS 1024
#define SMALL_LEN 15
typedef struct {
    uint8_t len; /* 0: empty slot */
    char s[SMALL_LEN];
    int64_t value;
} SmallSlot;

typedef struct {
    PyObject_HEAD
    PyObject *findall_ascii, *findall, *piece_words, *url_fullmatch;
    PyObject *special_pieces, *split_words; /* sets of str */
    PyObject *pieces;                       /* dict: piece -> its row's index (int) */
    Row *rows;
    Py_ssize_t n_rows, rows_cap;
    Py_ssize_t cache_size;
    int busy; /* in counts: its callbacks must not count or forget with this Counter */
    uint8_t ascii_punct[128];
    Py_UCS4 *punct; /* the non-ASCII punctuation, sorted */
    Py_ssize_t n_punct;
    SmallSlot split_alnum[SMALL_SLOTS];
    SmallSlot stop[SMALL_SLOTS];
} Counter;

static uint32_t small_hash(const char *s, Py_ssize_t n) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

static SmallSlot *small_find(SmallSlot *table, const char *s, Py_ssize_t n) {
    uint32_t at = small_hash(s, n) & (SMALL_SLOTS - 1);
    for (;; at = (at + 1) & (SMALL_SLOTS - 1)) {
        SmallSlot *slot = &table[at];
        if (slot->len == 0 || (slot->len == n && memcmp(slot->s, s, n) == 0)) return slot;
    }
}

/* table[key] = value; keys that are not ASCII or are longer than SMALL_LEN are refused. */
static int small_add(SmallSlot *table, PyObject *key, int64_t value, Py_ssize_t *used) {
    if (!PyUnicode_Check(key) || !PyUnicode_IS_ASCII(key) ||
        PyUnicode_GET_LENGTH(key) > SMALL_LEN || PyUnicode_GET_LENGTH(key) == 0) {
        PyErr_Format(PyExc_ValueError, "not a short ASCII word: %R", key);
        return -1;
    }
    if (++*used > SMALL_SLOTS / 2) {
        PyErr_SetString(PyExc_ValueError, "too many words for the compiled word counter");
        return -1;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(key);
    const char *s = (const char *)PyUnicode_1BYTE_DATA(key);
    SmallSlot *slot = small_find(table, s, n);
    slot->len = (uint8_t)n;
    memcpy(slot->s, s, n);
    slot->value = value;
    return 0;
}

/* The value of an ASCII piece [start, end) of text in table, or -1. */
static int64_t small_get(SmallSlot *table, int kind, const void *data, Py_ssize_t start,
                         Py_ssize_t end) {
    char buf[SMALL_LEN];
    Py_ssize_t n = end - start;
    if (n > SMALL_LEN) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, start + i);
        if (c >= 128) return -1;
        buf[i] = (char)c;
    }
    SmallSlot *slot = small_find(table, buf, n);
    return slot->len ? slot->value : -1;
}

static int is_punct(Counter *self, Py_UCS4 c) {
    if (c < 128) return self->ascii_punct[c];
    Py_ssize_t lo = 0, hi = self->n_punct;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->punct[mid] < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < self->n_punct && self->punct[lo] == c;
}

/* Adds one word, the characters [start, end) of a str's data, to row. */
static void count_word(Counter *self, Row *row, int kind, const void *data, Py_ssize_t start,
                       Py_ssize_t end) {
    int alpha = 0, plain = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        alpha |= Py_UNICODE_ISALPHA(c);
        plain |= !is_punct(self, c);
    }
    int real = plain || Py_UNICODE_ISALNUM(PyUnicode_READ(kind, data, start));
    int64_t stop = small_get(self->stop, kind, data, start, end);
    row->words += 1;
    row->real += real;
    row->real_chars += real ? end - start : 0;
    row->alpha += alpha;
    row->stop |= stop > 0 ? stop : 0;
}

static int popcount(int64_t bits) {
    int n = 0;
    for (uint64_t b = (uint64_t)bits; b; b &= b - 1) n++;
    return n;
}

static void add_row(Row *to, const Row *row) {
    to->words += row->words;
    to->real += row->real;
    to->real_chars += row->real_chars;
    to->alpha += row->alpha;
    to->stop |= row->stop;
}

/* spaCy's checks (_spacy_pieces): may _piece_words split this piece otherwise than its
 * regex words? 1 yes, 0 no, -1 error. */
static int spacy_may_change(Counter *self, PyObject *piece, PyObject *words) {
    int found = PySet_Contains(self->special_pieces, piece);
    if (found) return found;
    Py_ssize_t n_words = PySequence_Fast_GET_SIZE(words);
    for (Py_ssize_t k = 0; k < n_words; k++) {
        found = PySet_Contains(self->split_words, PySequence_Fast_GET_ITEM(words, k));
        if (found) return found;
    }
    int kind = PyUnicode_KIND(piece);
    const void *data = PyUnicode_DATA(piece);
    Py_ssize_t n = PyUnicode_GET_LENGTH(piece);
    int dot = 0, hint = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        Py_UCS4 next = i + 1 < n ? PyUnicode_READ(kind, data, i + 1) : 0;
        if (c >= '0' && c <= '9' && next == '+') return 1; /* _DIGIT_PLUS */
        dot |= c == '.';
        /* _URL_HINT: [-@/:=~<>,–—][^\W_] */
        int hint_char = c < 128 ? c != 0 && strchr("-@/:=~<>,", (int)c) != NULL
                                 : c == 0x2013 || c == 0x2014; /* – — */
        hint |= hint_char && next && Py_UNICODE_ISALNUM(next);
    }
    if (!(dot && hint)) return 0;
    PyObject *match = PyObject_CallOneArg(self->url_fullmatch, piece);
    if (match == NULL) return -1;
    found = match != Py_None;
    Py_DECREF(match);
    return found;
}

/* The row of a new piece: its words found by the regex (or spaCy's tables), then counted. */
static int learn(Counter *self, PyObject *piece, Row *row) {
    PyObject *findall = PyUnicode_IS_ASCII(piece) ? self->findall_ascii : self->findall;
    PyObject *found = PyObject_CallOneArg(findall, piece);
    if (found == NULL) return -1;
    PyObject *words = PySequence_Fast(found, "findall must give a sequence");
    Py_DECREF(found);
    if (words == NULL) return -1;
    int change = spacy_may_change(self, piece, words);
    if (change < 0) goto error;
    if (change) {
        Py_DECREF(words);
        found = PyObject_CallOneArg(self->piece_words, piece);
        if (found == NULL) return -1;
        words = PySequence_Fast(found, "piece_words must give a sequence");
        Py_DECREF(found);
        if (words == NULL) return -1;
    }
    memset(row, 0, sizeof(Row));
    Py_ssize_t n_words = PySequence_Fast_GET_SIZE(words);
    for (Py_ssize_t k = 0; k < n_words; k++) {
        PyObject *w = PySequence_Fast_GET_ITEM(words, k);
        if (!PyUnicode_Check(w) || PyUnicode_GET_LENGTH(w) == 0) {
            PyErr_Format(PyExc_TypeError, "a word must be a non-empty str: %R", w);
            goto error;
        }
        count_word(self, row, PyUnicode_KIND(w), PyUnicode_DATA(w), 0, PyUnicode_GET_LENGTH(w));
    }
    Py_DECREF(words);
    return 0;
error:
    Py_DECREF(words);
    return -1;
}

static void forget(Counter *self) {
    if (self->pieces != NULL) PyDict_Clear(self->pieces);
    self->n_rows = 0;
    Py_ssize_t usual = self->cache_size > ROWS_START ? self->cache_size : ROWS_START;
    if (self->rows_cap > 4 * usual) { /* a huge document's rows: give them back */
        PyMem_Free(self->rows);
        self->rows = NULL;
        self->rows_cap = 0;
    }
}

/* A new row's index (rows grow), or -1 with MemoryError. */
static Py_ssize_t new_row(Counter *self) {
    if (self->n_rows == self->rows_cap) {
        Py_ssize_t cap = self->rows_cap ? 2 * self->rows_cap : ROWS_START;
        Row *rows = PyMem_Realloc(self->rows, cap * sizeof(Row));
        if (rows == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->rows = rows;
        self->rows_cap = cap;
    }
    memset(&self->rows[self->n_rows], 0, sizeof(Row));
    return self->n_rows++;
}

static int refuse_if_busy(Counter *self) {
    if (self->busy)
        PyErr_SetString(PyExc_RuntimeError,
                        "a Counter cannot be used from its own callbacks (nor from two threads)");
    else if (self->pieces == NULL)
        PyErr_SetString(PyExc_RuntimeError, "Counter.__init__ was not called");
    else
        return 0;
    return -1;
}

static PyObject *count_text(Counter *self, PyObject *text);

static PyObject *Counter_counts(Counter *self, PyObject *text) {
    if (refuse_if_busy(self) < 0) return NULL;
    self->busy = 1;
    PyObject *result = count_text(self, text);
    self->busy = 0;
    return result;
}

static PyObject *count_text(Counter *self, PyObject *text) {
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "counts needs a str, not %.100s", Py_TYPE(text)->tp_name);
        return NULL;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(text) < 0) return NULL; /* a legacy str another extension made */
#endif
    /* forgotten all at once, before a document, when there are too many (as _Pieces.ids) */
    if (PyDict_GET_SIZE(self->pieces) > self->cache_size) forget(self);
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    Row total = {0, 0, 0, 0, 0};
    Py_ssize_t first_new = self->n_rows; /* rows from here on are counted after the scan */
    Py_ssize_t *pending = NULL, n_pending = 0, pending_cap = 0;
    PyObject *new_pieces = PyList_New(0);
    if (new_pieces == NULL) return NULL;

    Py_ssize_t i = 0;
    while (i < n) {
        while (i < n && Py_UNICODE_ISSPACE(PyUnicode_READ(kind, data, i))) i++;
        if (i == n) break;
        Py_ssize_t start = i;
        int alnum = 1;
        for (; i < n; i++) {
            Py_UCS4 c = PyUnicode_READ(kind, data, i);
            if (Py_UNICODE_ISSPACE(c)) break;
            if (alnum && !Py_UNICODE_ISALNUM(c)) alnum = 0;
        }
        if (alnum && small_get(self->split_alnum, kind, data, start, i) < 0) {
            count_word(self, &total, kind, data, start, i); /* one word as it is */
            continue;
        }
        PyObject *piece = PyUnicode_Substring(text, start, i);
        if (piece == NULL) goto error;
        PyObject *at = PyDict_GetItemWithError(self->pieces, piece);
        Py_ssize_t index;
        if (at != NULL) {
            index = PyLong_AsSsize_t(at);
        } else if (PyErr_Occurred()) {
            Py_DECREF(piece);
            goto error;
        } else {
            index = new_row(self);
            PyObject *value = index < 0 ? NULL : PyLong_FromSsize_t(index);
            int failed = value == NULL || PyDict_SetItem(self->pieces, piece, value) < 0 ||
                         PyList_Append(new_pieces, piece) < 0;
            Py_XDECREF(value);
            if (failed) {
                Py_DECREF(piece);
                goto error;
            }
        }
        Py_DECREF(piece);
        if (index < first_new) {
            add_row(&total, &self->rows[index]);
            continue;
        }
        if (n_pending == pending_cap) {
            pending_cap = pending_cap ? 2 * pending_cap : 256;
            Py_ssize_t *grown = PyMem_Realloc(pending, pending_cap * sizeof(Py_ssize_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto error;
            }
            pending = grown;
        }
        pending[n_pending++] = index;
    }
    /* learn this document's new pieces (in the order first met: rows first_new, ...) */
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(new_pieces); k++) {
        if (learn(self, PyList_GET_ITEM(new_pieces, k), &self->rows[first_new + k]) < 0)
            goto error;
    }
    for (Py_ssize_t k = 0; k < n_pending; k++) add_row(&total, &self->rows[pending[k]]);
    PyMem_Free(pending);
    Py_DECREF(new_pieces);
    return Py_BuildValue("(LLLLi)", (long long)total.words, (long long)total.real,
                         (long long)total.real_chars, (long long)total.alpha,
                         popcount(total.stop));
error:
    /* the pieces met in this document may have no rows yet: forget them all */
    forget(self);
    PyMem_Free(pending);
    Py_DECREF(new_pieces);
    return NULL;
}

static PyObject *Counter_forget(Counter *self, PyObject *Py_UNUSED(ignored)) {
    if (refuse_if_busy(self) < 0) return NULL;
    forget(self);
    Py_RETURN_NONE;
}

static Py_ssize_t Counter_len(Counter *self) {
    return self->pieces == NULL ? 0 : PyDict_GET_SIZE(self->pieces);
}

static int setup(Counter *self, PyObject *args, PyObject *kwargs);

/* A failed __init__ leaves the Counter unusable (as before __init__), never half set up. */
static int Counter_init(Counter *self, PyObject *args, PyObject *kwargs) {
    if (self->busy) return refuse_if_busy(self);
    if (setup(self, args, kwargs) == 0) return 0;
    Py_CLEAR(self->pieces);
    return -1;
}

static int setup(Counter *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"findall_ascii", "findall",     "piece_words", "url_fullmatch",
                            "special_pieces", "split_words", "split_alnum", "stop_bits",
                            "punctuation",    "cache_size",  NULL};
    PyObject *findall_ascii, *findall, *piece_words, *url_fullmatch, *special_pieces;
    PyObject *split_words, *split_alnum, *stop_bits, *punctuation;
    Py_ssize_t cache_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO!O!OO!On:Counter", names,
                                     &findall_ascii, &findall, &piece_words, &url_fullmatch,
                                     &PyFrozenSet_Type, &special_pieces, &PyFrozenSet_Type,
                                     &split_words, &split_alnum, &PyDict_Type, &stop_bits,
                                     &punctuation, &cache_size))
        return -1;
    Py_INCREF(findall_ascii), Py_INCREF(findall), Py_INCREF(piece_words);
    Py_INCREF(url_fullmatch), Py_INCREF(special_pieces), Py_INCREF(split_words);
    Py_XSETREF(self->findall_ascii, findall_ascii);
    Py_XSETREF(self->findall, findall);
    Py_XSETREF(self->piece_words, piece_words);
    Py_XSETREF(self->url_fullmatch, url_fullmatch);
    Py_XSETREF(self->special_pieces, special_pieces);
    Py_XSETREF(self->split_words, split_words);
    if (self->pieces == NULL && (self->pieces = PyDict_New()) == NULL) return -1;
    forget(self);
    self->cache_size = cache_size;
    memset(self->split_alnum, 0, sizeof(self->split_alnum));
    memset(self->stop, 0, sizeof(self->stop));

    Py_ssize_t used = 0;
    PyObject *it = PyObject_GetIter(split_alnum), *key;
    if (it == NULL) return -1;
    while ((key = PyIter_Next(it)) != NULL) {
        int failed = small_add(self->split_alnum, key, 1, &used);
        Py_DECREF(key);
        if (failed) break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return -1;
    used = 0;
    Py_ssize_t pos = 0;
    PyObject *value;
    while (PyDict_Next(stop_bits, &pos, &key, &value)) {
        int64_t bit = PyLong_AsLongLong(value);
        if ((bit == -1 && PyErr_Occurred()) || small_add(self->stop, key, bit, &used) < 0)
            return -1;
    }

    PyObject *chars = PySequence_List(punctuation);
    if (chars == NULL || PyList_Sort(chars) < 0) {
        Py_XDECREF(chars);
        return -1;
    }
    Py_ssize_t n_chars = PyList_GET_SIZE(chars);
    PyMem_Free(self->punct);
    self->punct = PyMem_Malloc((n_chars + 1) * sizeof(Py_UCS4));
    self->n_punct = 0;
    memset(self->ascii_punct, 0, sizeof(self->ascii_punct));
    for (Py_ssize_t k = 0; k < n_chars; k++) {
        PyObject *c = PyList_GET_ITEM(chars, k);
        if (!PyUnicode_Check(c) || PyUnicode_GET_LENGTH(c) != 1) {
            PyErr_Format(PyExc_ValueError, "punctuation must be characters: %R", c);
            Py_DECREF(chars);
            return -1;
        }
        Py_UCS4 cp = PyUnicode_READ_CHAR(c, 0);
        if (cp < 128)
            self->ascii_punct[cp] = 1;
        else if (self->punct != NULL)
            self->punct[self->n_punct++] = cp; /* sorted: str order is code point order */
    }
    Py_DECREF(chars);
    if (self->punct == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int Counter_traverse(Counter *self, visitproc visit, void *arg) {
    Py_VISIT(self->findall_ascii);
    Py_VISIT(self->findall);
    Py_VISIT(self->piece_words);
    Py_VISIT(self->url_fullmatch);
    Py_VISIT(self->special_pieces);
    Py_VISIT(self->split_words);
    Py_VISIT(self->pieces);
    return 0;
}

static int Counter_clear(Counter *self) {
    Py_CLEAR(self->findall_ascii);
    Py_CLEAR(self->findall);
    Py_CLEAR(self->piece_words);
    Py_CLEAR(self->url_fullmatch);
    Py_CLEAR(self->special_pieces);
    Py_CLEAR(self->split_words);
    Py_CLEAR(self->pieces);
    return 0;
}

static void Counter_dealloc(Counter *self) {
    PyObject_GC_UnTrack(self);
    Counter_clear(self);
    PyMem_Free(self->rows);
    PyMem_Free(self->punct);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Counter_methods[] = {
    {"counts", (PyCFunction)Counter_counts, METH_O,
     "counts(text) -> (words, real words, characters in real words, words with a letter, "
     "distinct stop words)"},
    {"forget", (PyCFunction)Counter_forget, METH_NOARGS, "Forget the pieces kept."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Counter_members[] = {
    {"cache_size", T_PYSSIZET, offsetof(Counter, cache_size), 0,
     "pieces kept before all are forgotten"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Counter_as_sequence = {.sq_length = (lenfunc)Counter_len};

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pipeline.clean._wordcount.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Gopher's word counts of texts, the pieces' rows cached (filters._Pieces.counts).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counter_init,
    .tp_dealloc = (destructor)Counter_dealloc,
    .tp_traverse = (traverseproc)Counter_traverse,
    .tp_clear = (inquiry)Counter_clear,
    .tp_methods = Counter_methods,
    .tp_members = Counter_members,
    .tp_as_sequence = &Counter_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wordcount", "Gopher's word counts, compiled (see Counter).", -1,
};

PyMODINIT_FUNC PyInit__wordcount(void) {
    if (PyType_Ready(&CounterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CounterType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0) {
        Py_DECREF(&CounterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
