echo banana >> /app/notes.txt
