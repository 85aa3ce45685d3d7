/* Gopher's word counts of a text, compiled: what pipeline/clean/words.py's _Pieces.counts
 * computes, with the same words. This file does the steps that cost most in Python: splitting
 * the text at white space, looking each piece up in a cache, finding an ASCII piece's words
 * (words._WORD_FAST_ASCII, written out as C), spaCy's checks on a new piece, and counting each
 * word's characters. Other pieces' words still come from the Python objects it is given (the
 * _WORD_FAST regex, and _piece_words where spaCy's tables may change them).
 *
 * ascii_words(text) -> _WORD_FAST_ASCII.findall(text), for ASCII text
 * Counter(findall_ascii, findall, piece_words, url_fullmatch, special_pieces, split_words,
 *         split_alnum, stop_bits, punctuation, cache_size)
 *     findall_ascii: ascii_words (then called as C, no str made per word) or a Python callable
 * Counter.counts(text) -> (words, real words, characters in real words, words with a letter,
 *                          distinct stop words)
 * Counter.forget()
 *
 * Definitions (words.py holds the reference, tests/test_clean.py holds both to them):
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
#define SPANS_KEPT (1 << 14) /* words_of's span entries kept between pieces */

/* A small set of short ASCII strings (split_alnum, the stop words), each with a value. */
#define SMALL_SLOTS 4096
#define SMALL_LEN 15
typedef struct {
    uint8_t len; /* 0: empty slot */
    char s[SMALL_LEN];
    int64_t value;
} SmallSlot;

typedef struct {
    SmallSlot slots[SMALL_SLOTS];
    uint8_t has_len[SMALL_LEN + 1], has_first[128]; /* what a look-up may skip at once */
    Py_ssize_t used;
} SmallTable;

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
    int compiled_ascii; /* findall_ascii is ascii_words: words of ASCII pieces found by words_of */
    Py_ssize_t *spans;  /* words_of's spans: start, end, start, end, ... */
    Py_ssize_t spans_cap;
    uint8_t latin1[256]; /* LATIN1_* flags of the characters below 256 */
    SmallTable split_alnum, stop;
    SmallTable split_ascii; /* the ASCII words of split_words */
} Counter;

static uint32_t small_hash(const char *s, Py_ssize_t n) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

static SmallSlot *small_find(SmallTable *table, const char *s, Py_ssize_t n) {
    uint32_t at = small_hash(s, n) & (SMALL_SLOTS - 1);
    for (;; at = (at + 1) & (SMALL_SLOTS - 1)) {
        SmallSlot *slot = &table->slots[at];
        if (slot->len == 0 || (slot->len == n && memcmp(slot->s, s, n) == 0)) return slot;
    }
}

/* table[key] = value; keys that are not ASCII or are longer than SMALL_LEN are refused. */
static int small_add(SmallTable *table, PyObject *key, int64_t value) {
    if (!PyUnicode_Check(key) || !PyUnicode_IS_ASCII(key) ||
        PyUnicode_GET_LENGTH(key) > SMALL_LEN || PyUnicode_GET_LENGTH(key) == 0) {
        PyErr_Format(PyExc_ValueError, "not a short ASCII word: %R", key);
        return -1;
    }
    if (++table->used > SMALL_SLOTS / 2) {
        PyErr_SetString(PyExc_ValueError, "too many words for the compiled word counter");
        return -1;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(key);
    const char *s = (const char *)PyUnicode_1BYTE_DATA(key);
    SmallSlot *slot = small_find(table, s, n);
    slot->len = (uint8_t)n;
    memcpy(slot->s, s, n);
    slot->value = value;
    table->has_len[n] = table->has_first[(uint8_t)s[0]] = 1;
    return 0;
}

/* Empties table, then adds each str of words with the value 1; ascii_only: skips the others
 * (else they are refused). */
static int small_fill(SmallTable *table, PyObject *words, int ascii_only) {
    memset(table, 0, sizeof(*table));
    PyObject *it = PyObject_GetIter(words), *key;
    if (it == NULL) return -1;
    while ((key = PyIter_Next(it)) != NULL) {
        int skip = ascii_only && !(PyUnicode_Check(key) && PyUnicode_IS_ASCII(key));
        int failed = !skip && small_add(table, key, 1) < 0;
        Py_DECREF(key);
        if (failed) break;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* The value of an ASCII piece [start, end) of text in table, or -1. */
static int64_t small_get(SmallTable *table, int kind, const void *data, Py_ssize_t start,
                         Py_ssize_t end) {
    char buf[SMALL_LEN];
    Py_ssize_t n = end - start;
    if (n > SMALL_LEN || !table->has_len[n]) return -1;
    Py_UCS4 first = PyUnicode_READ(kind, data, start);
    if (first >= 128 || !table->has_first[first]) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, start + i);
        if (c >= 128) return -1;
        buf[i] = (char)c;
    }
    SmallSlot *slot = small_find(table, buf, n);
    return slot->len ? slot->value : -1;
}

/* ---------------------------------------------------------------------------------------------
 * _WORD_FAST_ASCII.findall compiled: the words of an ASCII string, the regex's alternatives
 * tried in its order at each position, each written out as the regex engine runs it (possessive
 * repeats take all they can and give nothing back; the optional groups try their first branch
 * first). tests/test_clean.py holds ascii_words equal to the regex on random and adversarial
 * text. In re.ASCII, \w is [A-Za-z0-9_], [^\W_] [A-Za-z0-9], [^\W\d_] [A-Za-z], \s [ \t\n\v\f\r].
 */
enum {
    C_W = 1,      /* \w */
    C_AN = 2,     /* [^\W_]: a letter or digit */
    C_L = 4,      /* [^\W\d_]: a letter */
    C_D = 8,      /* \d */
    C_SP = 16,    /* \s */
    C_AFFIX = 32, /* _AFFIX: what spaCy splits off a piece's ends */
    C_SUFFIX = 64,
    C_URL_STOP = 128,  /* where a URL's run ends: \s < > " ' ( ) [ ] */
    C_URL_TRIM = 256,  /* what a URL does not end with, besides those: . , ; : ! ? */
    C_SYM = 512,       /* [^\w\s] */
};
static uint16_t CLS[128];
/* sha256 of words._WORD_FAST_PATTERN, the pattern word_end is written for (words.py uses
 * ascii_words only while its pattern still hashes to this) */
#define PATTERN_SHA256 "b2e753c9e21fa90553339a206e5083c029d277f954fd2063c3e72315a4779d6d"
static PyObject *ASCII_WORDS; /* the module's ascii_words: a Counter given it uses words_of */

static void init_classes(void) {
    for (int c = 0; c < 128; c++) {
        int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'), digit = c >= '0' && c <= '9';
        int space = c == ' ' || (c >= '\t' && c <= '\r');
        uint16_t k = 0;
        if (alpha || digit || c == '_') k |= C_W;
        if (alpha || digit) k |= C_AN;
        if (alpha) k |= C_L;
        if (digit) k |= C_D;
        if (space) k |= C_SP;
        if (!(k & (C_W | C_SP))) k |= C_SYM;
        if (c && strchr("!\"#$%&'()*+,:;<=>?[]`{}", c)) k |= C_AFFIX;
        if (c && strchr("!\"#&'()*,.:;<>?[]`{}", c)) k |= C_SUFFIX;
        if (space || (c && strchr("<>\"'()[]", c))) k |= C_URL_STOP;
        if (c && strchr(".,;:!?", c)) k |= C_URL_TRIM;
        CLS[c] = k;
    }
}

#define IS(i, k) ((i) >= 0 && (i) < n && (CLS[s[i]] & (k)))
#define CH(i, c) ((i) >= 0 && (i) < n && s[i] == (c))
#define ANY_OF(i, set) ((i) >= 0 && (i) < n && s[i] && strchr(set, s[i]) != NULL)

/* {contraction} at i: ['’](?:[sSmM]|ll|LL|re|RE|ve|VE)(?![^\W_]) from i + 1 (the quote is at
 * i); its length without the quote, or 0. */
static int contraction_at(const unsigned char *s, Py_ssize_t n, Py_ssize_t i) {
    if (ANY_OF(i, "sSmM") && !IS(i + 1, C_AN)) return 1;
    if (i + 1 < n && !IS(i + 2, C_AN)) {
        static const char *pairs[] = {"ll", "LL", "re", "RE", "ve", "VE"};
        for (int k = 0; k < 6; k++)
            if (s[i] == pairs[k][0] && s[i + 1] == pairs[k][1]) return 2;
    }
    return 0;
}

/* The word alternative's look-ahead before a run of symbols inside a word: spaCy's infixes
 * (a-b a/b a:b a,b a--b 1-2 a..b) and contractions, where the word must not go on. */
static int infix_at(const unsigned char *s, Py_ssize_t n, Py_ssize_t q) {
    return (ANY_OF(q, "-~:<>=/,") && IS(q + 1, C_L)) ||
           (CH(q, '-') && CH(q + 1, '-') && (IS(q + 2, C_L) || (CH(q + 2, '-') && IS(q + 3, C_L)))) ||
           (ANY_OF(q, "-+*^") && IS(q - 1, C_D) && (IS(q + 1, C_D) || CH(q + 1, '-'))) ||
           (CH(q, '.') && CH(q + 1, '.')) || (CH(q, '\'') && contraction_at(s, n, q + 1));
}

static const char *ABBREVIATIONS[] = {"Inc", "Ltd", "Co",  "Corp", "vs",  "Dr",  "Mr",  "Mrs",
                                      "Ms",  "St",  "Jr",  "Sr",   "Jan", "Feb", "Mar", "Apr",
                                      "Jun", "Jul", "Aug", "Sep",  "Sept", "Oct", "Nov", "Dec"};
#define N_ABBREVIATIONS (sizeof(ABBREVIATIONS) / sizeof(*ABBREVIATIONS))

/* The word alternative, (prefix symbols |) [^\W_]++ (joined parts)*+ (suffix symbols |): the
 * end of its match at p, or -1. */
static Py_ssize_t word_alternative_end(const unsigned char *s, Py_ssize_t n, Py_ssize_t p) {
    unsigned char c = s[p];
    Py_ssize_t q = -1;
    if (p == 0 || IS(p - 1, C_SP | C_AFFIX)) { /* (?<![^\s{affix}]) */
        if (c == '+' && IS(p + 1, C_D)) {
            q = p + 1; /* \+(?=\d) */
        } else if (IS(p, C_SYM) && !IS(p, C_AFFIX) && !(c == '.' && CH(p + 1, '.'))) {
            Py_ssize_t r = p; /* (?!\.\.)[^\w\s{affix}]++ */
            while (IS(r, C_SYM) && !IS(r, C_AFFIX)) r++;
            if (IS(r, C_AN)) q = r;
        }
    }
    if (q < 0 && IS(p, C_AN)) q = p;
    if (q < 0) return -1;
    while (IS(q, C_AN)) q++;
    for (;;) {
        Py_ssize_t r = q;
        if (CH(q, '_')) { /* __*+ */
            while (CH(r, '_')) r++;
        } else if (CH(q, '/') && IS(q - 1, C_W) && CH(q + 1, 'o') && CH(q + 2, 'r') &&
                   !IS(q + 3, C_W)) { /* /(?<=\w/)(?=or\b) */
            r = q + 1;
        } else if (IS(q, C_SYM) && !infix_at(s, n, q)) { /* (?!infixes)[^\w\s]++ */
            while (IS(r, C_SYM)) r++;
        }
        if (r == q || !IS(r, C_AN)) break; /* then [^\W_]++, or the repeat ends here */
        for (q = r; IS(q, C_AN); q++) {
        }
    }
    /* [^\w\s]*[^\w\s{suffix}](?=[{suffix}]*+(?!\S)): symbols up to the last that is not a
     * suffix, where only suffix symbols follow it to the end of the piece */
    Py_ssize_t r = q;
    while (IS(r, C_SYM)) r++;
    if (r == n || IS(r, C_SP)) {
        Py_ssize_t t = r;
        while (t > q && IS(t - 1, C_SUFFIX)) t--;
        if (t > q) q = t;
    }
    return q;
}

/* The end of the regex's match at p (p itself where nothing matches: white space). */
static Py_ssize_t word_end(const unsigned char *s, Py_ssize_t n, Py_ssize_t p) {
    unsigned char c = s[p];
    if (CLS[c] & C_SP) return p;
    /* \w\w*+://[^\s<>"'()\[\]]*[^\s<>"'()\[\].,;:!?]   URL */
    if (IS(p, C_W)) {
        Py_ssize_t q = p, end = -1;
        while (IS(q, C_W)) q++;
        if (CH(q, ':') && CH(q + 1, '/') && CH(q + 2, '/')) {
            for (Py_ssize_t r = q + 3; r < n && !(CLS[s[r]] & C_URL_STOP); r++)
                if (!(CLS[s[r]] & C_URL_TRIM)) end = r + 1;
            if (end > 0) return end;
        }
    }
    /* [^\W\d_](?<![\w.].)\.(?:[^\W\d_]\.)*+(?![^\W_])   a. e.g. U.S.A. */
    if (IS(p, C_L) && !IS(p - 1, C_W) && !CH(p - 1, '.') && CH(p + 1, '.')) {
        Py_ssize_t q = p + 2;
        while (IS(q, C_L) && CH(q + 1, '.')) q += 2;
        if (!IS(q, C_AN)) return q;
    }
    /* \b(?:Inc|Ltd|...)\.(?!\w)   abbreviations */
    if (IS(p, C_L) && !IS(p - 1, C_W)) { /* each is all letters: the letters from p, then "." */
        Py_ssize_t q = p;
        while (IS(q, C_L) && q - p < 5) q++;
        if (q - p >= 2 && q - p <= 4 && CH(q, '.') && !IS(q + 1, C_W))
            for (size_t k = 0; k < N_ABBREVIATIONS; k++)
                if ((Py_ssize_t)strlen(ABBREVIATIONS[k]) == q - p &&
                    memcmp(s + p, ABBREVIATIONS[k], q - p) == 0)
                    return q + 1;
    }
    Py_ssize_t end = word_alternative_end(s, n, p);
    if (end >= 0) return end;
    /* \.\.\.*+ | --\-*+ | '' */
    if ((c == '.' || c == '-') && CH(p + 1, c)) {
        Py_ssize_t r = p + 2;
        while (CH(r, c)) r++;
        return r;
    }
    if (c == '\'' && CH(p + 1, '\'')) return p + 2;
    /* ['’](?<=\w.){contraction letters}(?![^\W_]) */
    if (c == '\'' && IS(p - 1, C_W)) {
        int k = contraction_at(s, n, p + 1);
        if (k) return p + 1 + k;
    }
    return p + 1; /* [^\w\s] | _ */
}

/* The words of ASCII s as spans into *spans (start, end, ...; grown as needed): their number,
 * or -1 with MemoryError. */
static Py_ssize_t words_of(const unsigned char *s, Py_ssize_t n, Py_ssize_t **spans,
                           Py_ssize_t *cap) {
    Py_ssize_t count = 0;
    for (Py_ssize_t p = 0; p < n;) {
        Py_ssize_t end = word_end(s, n, p);
        if (end == p) {
            p++;
            continue;
        }
        if (2 * count + 2 > *cap) {
            Py_ssize_t grown_cap = *cap ? 2 * *cap : 64;
            Py_ssize_t *grown = PyMem_Realloc(*spans, grown_cap * sizeof(Py_ssize_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            *spans = grown, *cap = grown_cap;
        }
        (*spans)[2 * count] = p, (*spans)[2 * count + 1] = end;
        count++;
        p = end;
    }
    return count;
}

#undef IS
#undef CH
#undef ANY_OF

/* ascii_words(text) -> list of str: _WORD_FAST_ASCII.findall(text), for ASCII text. */
static PyObject *ascii_words(PyObject *Py_UNUSED(module), PyObject *text) {
    if (!PyUnicode_Check(text) || !PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "ascii_words needs an ASCII str");
        return NULL;
    }
    Py_ssize_t *spans = NULL, cap = 0;
    Py_ssize_t count = words_of(PyUnicode_1BYTE_DATA(text), PyUnicode_GET_LENGTH(text), &spans,
                                &cap);
    PyObject *words = count < 0 ? NULL : PyList_New(count);
    for (Py_ssize_t k = 0; words != NULL && k < count; k++) {
        PyObject *w = PyUnicode_Substring(text, spans[2 * k], spans[2 * k + 1]);
        if (w == NULL) Py_CLEAR(words);
        else PyList_SET_ITEM(words, k, w);
    }
    PyMem_Free(spans);
    return words;
}

/* Flags of a character below 256, as the Py_UNICODE_IS* macros and punctuation say. */
enum { LATIN1_SPACE = 1, LATIN1_ALNUM = 2, LATIN1_ALPHA = 4, LATIN1_PUNCT = 8 };

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
    int alpha = 0, plain = 0, real;
    if (kind == PyUnicode_1BYTE_KIND) {
        const Py_UCS1 *b = data;
        for (Py_ssize_t i = start; i < end; i++) {
            uint8_t f = self->latin1[b[i]];
            alpha |= f & LATIN1_ALPHA;
            plain |= !(f & LATIN1_PUNCT);
        }
        real = plain || (self->latin1[b[start]] & LATIN1_ALNUM);
    } else {
        for (Py_ssize_t i = start; i < end; i++) {
            Py_UCS4 c = PyUnicode_READ(kind, data, i);
            alpha |= Py_UNICODE_ISALPHA(c);
            plain |= !is_punct(self, c);
        }
        real = plain || Py_UNICODE_ISALNUM(PyUnicode_READ(kind, data, start));
    }
    int64_t stop = small_get(&self->stop, kind, data, start, end);
    row->words += 1;
    row->real += real;
    row->real_chars += real ? end - start : 0;
    row->alpha += alpha != 0;
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

/* spaCy's checks on a piece that the words themselves do not decide (_spacy_pieces): a + after
 * a digit, a URL. 1 yes, 0 no, -1 error. */
static int digit_plus_or_url(Counter *self, PyObject *piece) {
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
    int found = match != Py_None;
    Py_DECREF(match);
    return found;
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
    return digit_plus_or_url(self, piece);
}

/* learn, for an ASCII piece whose words words_of finds: no str is made for them, and spaCy's
 * word check is a look-up in split_ascii. 1 when spaCy's tables may change the words (the
 * caller then asks piece_words), 0 when counted into row, -1 error. */
static int learn_ascii(Counter *self, PyObject *piece, Row *row) {
    int found = PySet_Contains(self->special_pieces, piece);
    if (found) return found;
    const unsigned char *s = PyUnicode_1BYTE_DATA(piece);
    Py_ssize_t count = words_of(s, PyUnicode_GET_LENGTH(piece), &self->spans, &self->spans_cap);
    if (count < 0) return -1;
    const Py_ssize_t *spans = self->spans;
    for (Py_ssize_t k = 0; k < count && !found; k++)
        found = small_get(&self->split_ascii, PyUnicode_1BYTE_KIND, s, spans[2 * k],
                          spans[2 * k + 1]) >= 0;
    if (!found) found = digit_plus_or_url(self, piece);
    if (!found) {
        memset(row, 0, sizeof(Row));
        for (Py_ssize_t k = 0; k < count; k++)
            count_word(self, row, PyUnicode_1BYTE_KIND, s, spans[2 * k], spans[2 * k + 1]);
    }
    if (self->spans_cap > SPANS_KEPT) { /* a huge piece's spans: give them back */
        PyMem_Free(self->spans);
        self->spans = NULL;
        self->spans_cap = 0;
    }
    return found;
}

/* The row of a new piece: its words found by the regex (or spaCy's tables), then counted. */
static int learn(Counter *self, PyObject *piece, Row *row) {
    int change;
    PyObject *found, *words = NULL;
    if (self->compiled_ascii && PyUnicode_IS_ASCII(piece)) {
        change = learn_ascii(self, piece, row);
        if (change <= 0) return change;
    } else {
        PyObject *findall = PyUnicode_IS_ASCII(piece) ? self->findall_ascii : self->findall;
        found = PyObject_CallOneArg(findall, piece);
        if (found == NULL) return -1;
        words = PySequence_Fast(found, "findall must give a sequence");
        Py_DECREF(found);
        if (words == NULL) return -1;
        change = spacy_may_change(self, piece, words);
        if (change < 0) goto error;
    }
    if (change) {
        Py_XDECREF(words);
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

/* The row of the piece text[start:end) in the cache; a new row when it is not there yet (the
 * piece is then appended to new_pieces, its row counted once learnt). -1 on error. */
static Py_ssize_t piece_row(Counter *self, PyObject *text, Py_ssize_t start, Py_ssize_t end,
                            PyObject *new_pieces) {
    PyObject *piece = PyUnicode_Substring(text, start, end);
    if (piece == NULL) return -1;
    PyObject *at = PyDict_GetItemWithError(self->pieces, piece);
    Py_ssize_t index = -1;
    if (at != NULL) {
        index = PyLong_AsSsize_t(at);
    } else if (!PyErr_Occurred()) {
        index = new_row(self);
        PyObject *value = index < 0 ? NULL : PyLong_FromSsize_t(index);
        if (value == NULL || PyDict_SetItem(self->pieces, piece, value) < 0 ||
            PyList_Append(new_pieces, piece) < 0)
            index = -1;
        Py_XDECREF(value);
    }
    Py_DECREF(piece);
    return index;
}

/* The next piece of data from *end on: [*start, *end); 1 when it is letters and digits only, 0
 * when not, -1 when only white space is left. */
static int next_piece(Counter *self, int kind, const void *data, Py_ssize_t n, Py_ssize_t *start,
                      Py_ssize_t *end) {
    Py_ssize_t i = *end;
    int alnum = 1;
    if (kind == PyUnicode_1BYTE_KIND) { /* the same, the flags from latin1 */
        const Py_UCS1 *b = data;
        while (i < n && (self->latin1[b[i]] & LATIN1_SPACE)) i++;
        if (i == n) return -1;
        for (*start = i; i < n; i++) {
            uint8_t f = self->latin1[b[i]];
            if (f & LATIN1_SPACE) break;
            alnum &= (f & LATIN1_ALNUM) != 0;
        }
    } else {
        while (i < n && Py_UNICODE_ISSPACE(PyUnicode_READ(kind, data, i))) i++;
        if (i == n) return -1;
        for (*start = i; i < n; i++) {
            Py_UCS4 c = PyUnicode_READ(kind, data, i);
            if (Py_UNICODE_ISSPACE(c)) break;
            if (alnum && !Py_UNICODE_ISALNUM(c)) alnum = 0;
        }
    }
    *end = i;
    return alnum;
}

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
        Py_ssize_t start;
        int alnum = next_piece(self, kind, data, n, &start, &i);
        if (alnum < 0) break;
        if (alnum && small_get(&self->split_alnum, kind, data, start, i) < 0) {
            count_word(self, &total, kind, data, start, i); /* one word as it is */
            continue;
        }
        Py_ssize_t index = piece_row(self, text, start, i, new_pieces);
        if (index < 0) goto error;
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
static int set_characters(Counter *self, PyObject *punctuation);

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
    self->compiled_ascii = findall_ascii == ASCII_WORDS;
    /* split_words' ASCII words: the only ones an ASCII piece's words can be */
    if (small_fill(&self->split_alnum, split_alnum, 0) < 0 ||
        small_fill(&self->split_ascii, split_words, 1) < 0)
        return -1;
    memset(&self->stop, 0, sizeof(self->stop));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(stop_bits, &pos, &key, &value)) {
        int64_t bit = PyLong_AsLongLong(value);
        if ((bit == -1 && PyErr_Occurred()) || small_add(&self->stop, key, bit) < 0) return -1;
    }
    return set_characters(self, punctuation);
}

/* The punctuation (ascii_punct, punct: sorted) and the flags of the characters below 256. */
static int set_characters(Counter *self, PyObject *punctuation) {
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
    for (Py_UCS4 c = 0; c < 256; c++)
        self->latin1[c] = (Py_UNICODE_ISSPACE(c) ? LATIN1_SPACE : 0) |
                          (Py_UNICODE_ISALNUM(c) ? LATIN1_ALNUM : 0) |
                          (Py_UNICODE_ISALPHA(c) ? LATIN1_ALPHA : 0) |
                          (is_punct(self, c) ? LATIN1_PUNCT : 0);
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
    PyMem_Free(self->spans);
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "codex.pipeline.clean._wordcount.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Gopher's word counts of texts, the pieces' rows cached (words._Pieces.counts).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counter_init,
    .tp_dealloc = (destructor)Counter_dealloc,
    .tp_traverse = (traverseproc)Counter_traverse,
    .tp_clear = (inquiry)Counter_clear,
    .tp_methods = Counter_methods,
    .tp_members = Counter_members,
    .tp_as_sequence = &Counter_as_sequence,
};

static PyMethodDef module_methods[] = {
    {"ascii_words", (PyCFunction)ascii_words, METH_O,
     "ascii_words(text) -> list of str: words._WORD_FAST_ASCII.findall(text), for ASCII text"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wordcount", "Gopher's word counts, compiled (see Counter).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wordcount(void) {
    if (PyType_Ready(&CounterType) < 0) return NULL;
    init_classes();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    ASCII_WORDS = PyObject_GetAttrString(m, "ascii_words"); /* kept for the module's life */
    if (ASCII_WORDS == NULL || PyModule_AddStringConstant(m, "PATTERN_SHA256", PATTERN_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CounterType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0) {
        Py_DECREF(&CounterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
